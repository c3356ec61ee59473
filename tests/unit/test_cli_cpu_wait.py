"""Every bench (and campaign) that launches real vLLM takes the same ``--cpu-wait {yield,nap}`` (one
definition: ``ftengine.testbed.cli.launch.add_cpu_wait_arg``), default vLLM's own."""

from __future__ import annotations

import argparse
from types import ModuleType

import pytest

from ftengine.testbed.cli import bench_hosts, bench_inflight, bench_rejoin, bench_vllm, chaos_vllm

BENCHES = (bench_hosts, bench_inflight, bench_rejoin, bench_vllm, chaos_vllm)
REQUIRED = {bench_vllm: ["--checkpoint", "ckpt"], chaos_vllm: ["--checkpoint", "ckpt"]}


@pytest.mark.parametrize("bench", BENCHES, ids=lambda b: b.__name__.rsplit(".", 1)[-1])
def test_cpu_wait_takes_yield_or_nap_and_defaults_to_vllms_yield(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser)
    given = REQUIRED.get(bench, [])
    assert parser.parse_args(given).cpu_wait == "yield"
    assert parser.parse_args([*given, "--cpu-wait", "nap"]).cpu_wait == "nap"
    with pytest.raises(SystemExit):
        parser.parse_args([*given, "--cpu-wait", "sleep"])
    assert "invalid choice: 'sleep' (choose from" in capsys.readouterr().err
