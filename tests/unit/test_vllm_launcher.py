"""The launcher's command lines and its refusals, before anything starts."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from ftengine.cli import main
from ftengine.errors import ConfigError
from ftengine.testbed.vllm.launcher import (
    API_SERVER_MODULE,
    OMP_BIND_ENV,
    DeploymentConfig,
    rank_env,
)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_each_rank_is_an_external_lb_api_server_with_fault_tolerance(checkpoint: Path) -> None:
    config = DeploymentConfig(
        checkpoint,
        dp_size=3,
        port=9000,
        recovery_timeout_s=60,
        additional_config={"ftengine": {"policy": "auto"}},
        extra_args=("--seed", "1"),
        dtype="float32",
    )
    argv = config.argv(2, rpc_port=29555)
    assert argv[1:3] == ["-m", API_SERVER_MODULE]
    text = " ".join(argv)
    for flag in (
        f"--model {checkpoint}",
        "--port 9002",
        "--data-parallel-size 3 --data-parallel-rank 2",
        "--data-parallel-address 127.0.0.1 --data-parallel-rpc-port 29555",
        "--enable-expert-parallel",
        "--enable-fault-tolerance",
        "--gpu-memory-utilization 0.1",
        "--enforce-eager",
        "--dtype float32",
    ):
        assert flag in text
    assert json.loads(argv[argv.index("--fault-tolerance-config") + 1]) == {
        "engine_recovery_timeout_sec": 60
    }
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {
        "ftengine": {"policy": "auto"}
    }
    assert argv[-2:] == ["--seed", "1"]
    assert config.url(2) == "http://127.0.0.1:9002"


def test_without_fault_tolerance_no_ft_flags(checkpoint: Path) -> None:
    argv = DeploymentConfig(checkpoint, fault_tolerance=False).argv(0, rpc_port=1)
    assert "--enable-fault-tolerance" not in argv and "--fault-tolerance-config" not in argv
    assert "--dtype" not in argv  # "auto": vLLM's own default, the checkpoint's dtype


def test_each_rank_binds_its_cpu_worker_to_a_core_of_its_own(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {2, 5})
    config = DeploymentConfig(checkpoint, dp_size=4, env={"X": "1"})
    envs = [rank_env(config, rank, {"PATH": "/bin", "VLLM_PLUGINS": "other"}) for rank in range(4)]
    assert [env[OMP_BIND_ENV] for env in envs] == ["2", "5", "2", "5"]
    assert all(env["X"] == "1" and env["PATH"] == "/bin" for env in envs)
    assert envs[0]["VLLM_PLUGINS"].split(",") == ["other", "ftengine"]


def test_a_binding_the_user_set_is_kept(checkpoint: Path) -> None:
    chosen = DeploymentConfig(checkpoint, env={OMP_BIND_ENV: "nobind"})
    assert rank_env(chosen, 1, {})[OMP_BIND_ENV] == "nobind"
    assert rank_env(DeploymentConfig(checkpoint), 1, {OMP_BIND_ENV: "0"})[OMP_BIND_ENV] == "0"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dp_size": 0}, "dp_size must be >= 1"),
        ({"port": 70000}, "port must be a TCP port"),
        ({"port": 65535, "dp_size": 2}, "exceed 65535"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"dtype": "fp32"}, r"dtype must be one of .*'float32'.*, found 'fp32'"),
        ({"additional_config": {"ftengine": {"polcy": "auto"}}}, "unknown option ftengine.polcy"),
        ({"additional_config": {"ftengine": {"policy": "nowhere:x"}}}, "cannot import nowhere"),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(
    checkpoint: Path, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        DeploymentConfig(checkpoint, **overrides)  # type: ignore[arg-type]


def test_a_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"holding config\.json"):
        DeploymentConfig(tmp_path)


def test_vllm_up_refuses_bad_flags_with_exit_code_2(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["vllm", "up", "--checkpoint", str(checkpoint), "--dp", "0"]) == 2
    assert "dp_size must be >= 1" in capsys.readouterr().err
    code = main(["vllm", "up", "--checkpoint", str(checkpoint), "--additional-config", "[1]"])
    assert code == 2
    assert "must be a JSON object" in capsys.readouterr().err


def test_vllm_up_refuses_a_taken_port_before_starting(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        argv = ["vllm", "up", "--checkpoint", str(checkpoint), "--port", str(port), "--dp", "1"]
        assert main(argv) == 1
    assert f"port 127.0.0.1:{port} is taken" in capsys.readouterr().err
