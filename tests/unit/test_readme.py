"""The README's state diagram matches the table, the custom-policy example runs and is the
README's, verbatim, and the ``ftengine`` keys table shows the defaults the parser has."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from ftengine.fsm import TABLE, mermaid_rows, render_mermaid

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- fsm:begin -->\n```mermaid\n(.*?)\n```\n<!-- fsm:end -->", re.DOTALL)
POLICY_BLOCK = re.compile(
    r"<!-- custom-policy:begin -->\n```python\n(.*?)```\n<!-- custom-policy:end -->", re.DOTALL
)
EXAMPLE_REGION = re.compile(r"# readme:begin\n(.*?)\n*# readme:end", re.DOTALL)


def test_the_readme_diagram_is_the_generated_one_and_reads_back_as_the_table() -> None:
    found = BLOCK.search((ROOT / "README.md").read_text())
    assert found, "README.md needs the diagram between <!-- fsm:begin --> and <!-- fsm:end -->"
    diagram = found.group(1)
    assert mermaid_rows(diagram) == frozenset(TABLE), "diagram and table disagree"
    assert diagram == render_mermaid(), "regenerate it with `ftengine fsm --mermaid`"


def test_the_custom_policy_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "custom_policy.py"), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    assert "t=0.5s quarantined -> retrying: policy retry" in out
    assert out[-2:] == ["scale_down: success=True", "final: phase=healthy removed=[3]"]


def test_the_readmes_custom_policy_is_the_example_file_verbatim() -> None:
    block = POLICY_BLOCK.search((ROOT / "README.md").read_text())
    region = EXAMPLE_REGION.search((ROOT / "examples" / "custom_policy.py").read_text())
    assert block and region, "README.md and examples/custom_policy.py need their marks"
    assert block.group(1) == region.group(1) + "\n", "copy the example's region into README"


KEY_ROW = re.compile(r"^\| `(\w+)` \| [^|]+ \| `([^`]+)` \|", re.MULTILINE)


def test_the_keys_table_shows_the_parsers_defaults() -> None:
    """Each ``ftengine`` key whose README default is a literal: the parser's own default
    (re-inference is on unless a key says otherwise)."""
    import json

    from ftengine.backends.npu_config import NpuFtConfig

    shown = dict(KEY_ROW.findall((ROOT / "README.md").read_text()))
    defaults = NpuFtConfig.from_options({})
    keys = ("reinference", "max_reinference", "placement", "policy", "scale_down", "handoff_urls")
    for key in keys:  # (each is also the attribute's name)
        value = getattr(defaults, key)
        assert json.loads(shown[key]) == (list(value) if isinstance(value, tuple) else value), key
