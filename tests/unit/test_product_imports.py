"""What ``pip install ftengine`` users load: the vLLM plugin and the NPU backend, imported in
a fresh interpreter, bring in none of the test bed and none of its display or server
packages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PRODUCT_ENTRY_POINTS = (
    "ftengine.integrations.vllm.plugin",
    "ftengine.integrations.vllm_ascend.plugin",
    "ftengine.backends.npu",
)
FORBIDDEN_PACKAGES = ("fastapi", "uvicorn", "rich", "matplotlib")
TESTBED = "ftengine.testbed"


def _forbidden_loaded_by(module: str) -> list[str]:
    """The forbidden modules in ``sys.modules`` after ``import module`` in a fresh interpreter."""
    probe = (
        "import json, sys\n"
        f"import {module}\n"
        "print(json.dumps(sorted(\n"
        "    name for name in sys.modules\n"
        f"    if name.split('.')[0] in {FORBIDDEN_PACKAGES!r}\n"
        f"    or name == {TESTBED!r} or name.startswith({TESTBED + '.'!r})\n"
        ")))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded


@pytest.mark.parametrize("module", PRODUCT_ENTRY_POINTS)
def test_a_product_entry_point_loads_no_test_bed(module: str) -> None:
    loaded = _forbidden_loaded_by(module)
    assert loaded == [], f"importing {module} loaded {', '.join(loaded)}"


def test_the_probe_sees_the_test_bed_once_imported() -> None:
    loaded = _forbidden_loaded_by("ftengine.testbed.control.app")
    assert "fastapi" in loaded
    assert "ftengine.testbed.control.app" in loaded
