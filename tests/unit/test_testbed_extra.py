"""The product imports none of the ``testbed`` extra's packages (FastAPI, uvicorn, rich,
matplotlib, msgspec, ...): only ``ftengine.testbed`` does, and the command line reaches them
only inside the test bed's commands, where a missing package is named together with the
command that installs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from ftengine.testbed.cli.extras import TESTBED_EXTRA

PRODUCT = (
    "ftengine",
    "ftengine.engine",
    "ftengine.sentinel",
    "ftengine.integrations.vllm.plugin",
    "ftengine.integrations.vllm_ascend.plugin",
    "ftengine.backends.npu",
)
CLUSTER = (
    "ftengine.testbed.cpu.backend",
    "ftengine.testbed.cluster",
    "ftengine.testbed.control.app",
)
"""Test-bed modules that need no display package: the cluster and its HTTP server."""
DISPLAY = ("matplotlib", "rich")
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (nothing imported yet), capturing its output."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=False
    )


def _loaded_after(packages: tuple[str, ...], *steps: str) -> list[list[str]]:
    """Which of ``packages`` are in ``sys.modules`` after each of ``steps`` (statements run
    one after the other in one fresh interpreter)."""
    report = f"print(json.dumps(sorted(m for m in {sorted(packages)!r} if m in sys.modules)))"
    done = _python("\n".join(["import json, sys", *(f"{step}\n{report}" for step in steps)]))
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()[-len(steps) :]]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0] for line in requirements}


def test_the_extra_is_the_one_pyproject_declares_and_the_product_lacks() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert _names(project["optional-dependencies"]["testbed"]) == TESTBED_EXTRA
    assert {"fastapi", "matplotlib", "rich", "uvicorn"} <= TESTBED_EXTRA
    assert not _names(project["dependencies"]) & TESTBED_EXTRA


def test_the_product_and_the_parser_import_no_package_of_the_extra() -> None:
    product = "; ".join(f"import {name}" for name in PRODUCT)
    parser = "from ftengine.cli import build_parser; build_parser()"
    # The last step shows that the probe sees them once imported: the HTTP server.
    loaded = _loaded_after(
        tuple(TESTBED_EXTRA), product, parser, "import ftengine.testbed.control.app"
    )
    assert loaded[:2] == [[], []]
    assert "fastapi" in loaded[2]


def test_the_cluster_and_its_server_import_no_display_package() -> None:
    cluster = "; ".join(f"import {name}" for name in CLUSTER)
    # The last step shows that the probe sees them once imported: the demo's live view.
    assert _loaded_after(DISPLAY, cluster, "import ftengine.testbed.bench.live") == [[], ["rich"]]


@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        (["demo", "--json"], "rich"),
        (["bench", "reload", "--json"], "rich"),
        (["bench", "recovery", "--plot", "out.png"], "matplotlib"),
        (["chaos"], "msgspec"),
        (["serve"], "fastapi"),
    ],
)
def test_a_missing_package_is_named_with_the_install_command(argv: list[str], missing: str) -> None:
    done = _python(
        "import sys\n"
        f"sys.modules[{missing!r}] = None  # importing it now fails as if not installed\n"
        "from ftengine.cli import main\n"
        f"main({argv!r})\n"
    )
    assert done.returncode == 2, done.stderr[-3000:]
    command = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    assert f"ftengine {command}: needs the 'testbed' extra, but {missing!r} is not installed" in (
        done.stderr
    )
    assert "pip install 'ftengine[testbed]'" in done.stderr
