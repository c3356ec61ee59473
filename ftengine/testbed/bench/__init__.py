"""The demo, the benchmarks and their measurement tools (live views, traffic, page cache,
peak RSS, plots). Nothing in the library imports this package: ``ftengine.cli`` imports it
only inside the ``demo`` and ``bench ...`` commands, and its third-party needs (rich,
matplotlib, psutil) come with the ``bench`` extra (``pip install 'ftengine[bench]'``)."""
