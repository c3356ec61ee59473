"""``ftengine make-checkpoint``: writes a loadable checkpoint, reports it, refuses to clobber."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from ftengine.cli import build_parser, main
from ftengine.testbed.cli.checkpoint import phase_progress
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.integrity import Manifest


def test_writes_the_requested_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ck"
    args = ["--layers", "3", "--experts", "6", "--hidden", "48", "--intermediate", "24"]
    args += ["--dtype", "float16", "--shards", "2", "--seed", "4", "--top-k", "3"]
    assert main(["make-checkpoint", str(path), *args]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["path"] == str(path)
    assert summary["files"] == 2
    assert summary["quant"] == "none"
    assert summary["expert_bytes"] == 3 * 6 * 3 * 48 * 24 * 2
    index = CheckpointIndex.open(path)
    assert (index.num_layers, index.num_experts) == (3, 6)
    assert (index.hidden_size, index.intermediate_size, index.dtype) == (48, 24, torch.float16)
    assert index.config["num_experts_per_tok"] == 3


def test_tied_head_router_and_rope_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ck"
    flags = ["--tie-word-embeddings", "--no-norm-topk-prob", "--rope-theta", "5e5"]
    assert main(["make-checkpoint", str(path), *flags]) == 0
    capsys.readouterr()
    index = CheckpointIndex.open(path)
    assert "lm_head.weight" not in index.tensors
    assert (index.config["tie_word_embeddings"], index.config["norm_topk_prob"]) == (True, False)
    assert index.config["rope_parameters"]["rope_theta"] == 5e5
    assert (path / "tokenizer.json").is_file() and (path / "generation_config.json").is_file()


def test_w8a8_fused_with_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "q"
    flags = ["--quant", "w8a8_dynamic", "--fused-gate-up", "--manifest"]
    assert main(["make-checkpoint", str(path), *flags]) == 0
    assert json.loads(capsys.readouterr().out)["quant"] == "w8a8_dynamic"
    index = CheckpointIndex.open(path)
    assert index.quant == "w8a8_dynamic"
    assert index.fused_gate_up(0, 0)
    assert Manifest.load(path) is not None


def test_refuses_to_overwrite_without_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "ck")
    assert main(["make-checkpoint", path]) == 0
    capsys.readouterr()
    assert main(["make-checkpoint", path, "--shards", "1"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["make-checkpoint", path, "--shards", "1", "--overwrite"]) == 0
    assert len(list(Path(path).glob("*.safetensors"))) == 1


def test_bad_sizes_exit_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-checkpoint", str(tmp_path / "ck"), "--heads", "3", "--kv-heads", "2"]) == 2
    assert "heads divisible by kv_heads" in capsys.readouterr().err


def test_registered_commands() -> None:
    help_text = build_parser().format_help()
    assert "make-checkpoint" in help_text


def test_progress_reaches_the_total(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    make_checkpoint(
        tmp_path / "ck",
        layers=2,
        experts=2,
        hidden=16,
        intermediate=8,
        shards=3,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert len(calls) == 3
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)
    assert calls[-1][0] == calls[-1][1]


def test_progress_bar_renders_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = io.StringIO()
    monkeypatch.setattr(
        "rich.console.Console",
        lambda **_: Console(file=sink, force_terminal=True, width=100),
    )
    with phase_progress(True) as update:
        assert update is not None
        update("writing checkpoint", 50, 100)
        update("writing checkpoint", 100, 100)
    assert "writing checkpoint" in sink.getvalue()
    with phase_progress(False) as update:
        assert update is None


def test_without_rich_there_is_no_bar_and_the_checkpoint_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # rich comes with the 'testbed' extra; a None entry makes importing it fail as if absent.
    for name in ("rich", "rich.console", "rich.progress"):
        monkeypatch.setitem(sys.modules, name, None)
    with phase_progress(True) as update:
        assert update is None
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert main(["make-checkpoint", str(tmp_path / "ck")]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(tmp_path / "ck")
