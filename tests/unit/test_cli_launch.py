"""Shared CLI plumbing: flags map onto ClusterConfig; an existing checkpoint is reused."""

from __future__ import annotations

import argparse
from pathlib import Path

from ftengine.testbed.bench.prompts import prompts_for
from ftengine.testbed.cli.launch import (
    CheckpointSize,
    add_checkpoint_args,
    add_cluster_args,
    add_run_args,
    checkpoint_dir,
    cluster_config,
    run_checkpoint,
    size_from_args,
)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_checkpoint_args(parser, CheckpointSize(layers=3))
    add_cluster_args(parser)
    return parser.parse_args(list(argv))


def test_flags_map_onto_the_cluster_config(tmp_path: Path) -> None:
    args = _parse(
        "--dp-size", "3", "--policy", "auto", "--op-timeout", "1.5", "--heartbeat", "0.5",
        "--recovery-timeout", "9", "--inject-fault", "rank=1,step=4,kind=raise",
    )  # fmt: skip
    config = cluster_config(args, tmp_path, heartbeat_misses=3)
    assert (config.checkpoint, config.dp_size, config.policy) == (tmp_path, 3, "auto")
    assert (config.op_timeout_s, config.heartbeat_s, config.recovery_timeout_s) == (1.5, 0.5, 9.0)
    assert config.heartbeat_misses == 3
    assert str(config.inject_fault) == "rank=1,step=4,kind=raise"


def test_size_flags_default_to_the_given_size() -> None:
    assert size_from_args(_parse()) == CheckpointSize(layers=3)
    size = size_from_args(_parse("--experts", "4", "--quant", "w8a8_dynamic"))
    assert (size.layers, size.experts, size.quant) == (3, 4, "w8a8_dynamic")


def test_an_existing_checkpoint_is_reused_untouched(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with checkpoint_dir(tmp_path, CheckpointSize()) as path:
        assert path == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    assert (tmp_path / "config.json").read_text() == "{}"


def test_the_run_helpers_combine_flags_checkpoint_and_prompts(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_run_args(parser, CheckpointSize(layers=5), policy="auto")
    args = parser.parse_args(["--checkpoint", str(tmp_path), "--dp-size", "2"])
    assert (size_from_args(args).layers, args.policy, args.dp_size) == (5, "auto", 2)
    (tmp_path / "config.json").write_text('{"vocab_size": 7}')
    with run_checkpoint(args) as path:
        assert path == tmp_path
        prompts = prompts_for(path, 5)
    assert len(prompts) == 5 and all(0 <= token < 7 for p in prompts for token in p)
    assert prompts == prompts_for(tmp_path, 5)  # reproducible
    assert cluster_config(args, tmp_path, fault_tolerance=False).fault_tolerance is False
