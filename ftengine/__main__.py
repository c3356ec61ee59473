"""``python -m ftengine`` runs the command line."""

from ftengine.cli import main

raise SystemExit(main())
