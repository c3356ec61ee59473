"""``ftengine bench inflight`` keeps each vLLM row's rank logs (a row that lost a request
must be readable afterwards): the flag reaches the run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ftengine.cli.options import options_from_args
from ftengine.testbed.bench.inflight import InflightOptions, _vllm_run, setup
from ftengine.testbed.cli import bench_inflight


def test_the_log_dir_flag_reaches_the_vllm_run(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench_inflight.register(parser)
    args = parser.parse_args(
        ["--vllm-checkpoint", str(tmp_path), "--vllm-log-dir", str(tmp_path / "logs")]
    )
    run = _vllm_run(options_from_args(InflightOptions, args))
    assert run is not None and run.log_dir == tmp_path / "logs"
    default = _vllm_run(InflightOptions(vllm_checkpoint=tmp_path))
    assert default is not None and default.log_dir == Path("vllm-bench-logs/inflight")


def test_the_setup_in_the_json_has_the_paths_as_strings(tmp_path: Path) -> None:
    """What broke ``bench inflight`` once: a ``Path`` option in ``json.dumps``."""
    options = InflightOptions(vllm_checkpoint=tmp_path)
    written = json.loads(json.dumps(setup(options)))
    assert written["vllm_checkpoint"] == str(tmp_path)
    assert written["vllm_log_dir"] == "vllm-bench-logs/inflight"
    assert json.loads(json.dumps(setup(InflightOptions())))["vllm_checkpoint"] is None


def test_the_cpu_wait_flag_reaches_the_vllm_deployments(tmp_path: Path) -> None:
    """``--cpu-wait nap`` naps vLLM's queue waits in each row's deployment and is in the
    JSON's setup; the default is vLLM's own yield; another value is refused."""
    parser = argparse.ArgumentParser()
    bench_inflight.register(parser)
    args = parser.parse_args(["--vllm-checkpoint", str(tmp_path), "--cpu-wait", "nap"])
    options = options_from_args(InflightOptions, args)
    run = _vllm_run(options)
    assert run is not None and run.cpu_nap
    assert setup(options)["cpu_wait"] == "nap"
    default = _vllm_run(InflightOptions(vllm_checkpoint=tmp_path))
    assert default is not None and not default.cpu_nap
    with pytest.raises(ValueError, match="cpu_wait"):
        InflightOptions(cpu_wait="sleep")
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-wait", "sleep"])
