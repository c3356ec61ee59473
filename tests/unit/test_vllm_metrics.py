"""ftengine's metrics on vLLM's /metrics: the API server's collector reads the status files
its own engines' workers write, and nobody else's."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ftengine.integrations.vllm.api_server.metrics import EngineStateCollector, engine_states
from ftengine.integrations.vllm.status_file import StatusFile


@pytest.fixture
def tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def test_the_collector_reads_this_process_trees_engines_only(tmp_dir: Path) -> None:
    mine = StatusFile.for_engine_core(1)
    assert mine.path.parent == tmp_dir
    mine.write({"phase": "quarantined", "epoch": 2, "removed_ranks": [3], "attempts": 1})
    (tmp_dir / "ftengine-status-999999999-0.json").write_text('{"phase": "running"}')
    assert engine_states() == {
        1: {"phase": "quarantined", "epoch": 2, "removed_ranks": [3], "attempts": 1}
    }
    registry = CollectorRegistry()
    registry.register(EngineStateCollector())
    text = generate_latest(registry).decode()
    assert 'ftengine_engine_phase{engine="1",phase="quarantined"} 1.0' in text
    assert 'ftengine_engine_phase{engine="1",phase="running"} 0.0' in text
    assert 'ftengine_engine_epoch{engine="1"} 2.0' in text
    assert 'ftengine_engine_removed_ranks{engine="1"} 1.0' in text
    assert 'engine="0"' not in text  # another process tree's engine
