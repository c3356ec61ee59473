"""ft_communication_abort_timeout → exact HCCL env values and set_op_timeout_ms argument; the
rest of the environment FT needs (TASK_QUEUE_ENABLE, HCCL_ASYNC_ERROR_HANDLING)."""

from __future__ import annotations

import pytest

from ftengine.backends.npu_config import NpuFtConfig
from ftengine.backends.npu_env import apply_ft_environment, ft_environment_problems
from ftengine.backends.npu_runtime import NpuRuntime, TorchNpuUnavailable
from ftengine.backends.npu_timeouts import (
    TORCH_NPU_DEFAULT_OP_TIMEOUT_MS,
    OpTimeoutController,
    plan_op_timeout,
)
from ftengine.errors import ConfigError
from ftengine.weights.index import CheckpointIndex
from tests.fakes.npu_host import make_npu_rig
from tests.fakes.npu_state import Call, FakeNpuState
from tests.unit.npu_fixtures import TinyCheckpoints
from tests.unit.npu_fixtures import npu_state as npu_state
from tests.unit.npu_fixtures import tiny_checkpoints as tiny_checkpoints

EVENT, EXEC = "HCCL_EVENT_TIMEOUT", "HCCL_EXEC_TIMEOUT"
TASK_QUEUE, ASYNC_ERRORS = "TASK_QUEUE_ENABLE", "HCCL_ASYNC_ERROR_HANDLING"
TORCH_ASYNC_ERRORS = "TORCH_HCCL_ASYNC_ERROR_HANDLING"
"""torch_npu master's name for it (the old one deprecated there)."""
FT_ENV = {TASK_QUEUE: "0"}
"""What every FT worker's environment holds whatever T is (TP = 1)."""


@pytest.fixture(scope="module")
def index(tiny_checkpoints: TinyCheckpoints) -> CheckpointIndex:
    return tiny_checkpoints.index(layers=1, experts=4)


@pytest.mark.parametrize("seconds", [2, 3, 30, 120, 1800])
def test_backend_start_up_derives_env_and_op_timeout(
    npu_state: FakeNpuState, index: CheckpointIndex, seconds: int
) -> None:
    config = NpuFtConfig(communication_abort_timeout_s=seconds)
    rig = make_npu_rig(index, config=config, environ={"PATH": "/bin"})
    assert rig.environ == {
        "PATH": "/bin",
        **FT_ENV,
        EVENT: str(seconds),
        EXEC: str(seconds - 1),
    }
    assert npu_state.of("npu.set_op_timeout_ms") == [
        Call("npu.set_op_timeout_ms", (seconds * 1000,))
    ]
    assert rig.backend.timeouts.plan is not None
    plan = rig.backend.timeouts.plan
    assert (plan.event_timeout_s, plan.exec_timeout_s, plan.op_timeout_ms) == (
        seconds,
        seconds - 1,
        seconds * 1000,
    )


def test_zero_turns_everything_off(npu_state: FakeNpuState, index: CheckpointIndex) -> None:
    rig = make_npu_rig(index, config=NpuFtConfig(communication_abort_timeout_s=0))
    assert rig.environ == FT_ENV
    assert npu_state.of("npu.set_op_timeout_ms") == []


def test_users_exec_timeout_is_kept_as_in_the_seed_command(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    config = NpuFtConfig(communication_abort_timeout_s=30)
    rig = make_npu_rig(index, config=config, environ={EXEC: "1"})
    assert rig.environ == {EXEC: "1", **FT_ENV, EVENT: "30"}
    assert npu_state.of("npu.set_op_timeout_ms") == [Call("npu.set_op_timeout_ms", (30000,))]


@pytest.mark.parametrize("bad", [1, -1, -30, 2.5, True, "30", None, [30]])
def test_bad_abort_timeouts_are_rejected_naming_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match="ft_communication_abort_timeout"):
        NpuFtConfig.from_additional_config({"ft_communication_abort_timeout": bad})


def test_an_integral_float_in_the_config_is_rejected_as_vllm_ascend_does() -> None:
    # vLLM-Ascend validates ft_communication_abort_timeout as an int (#14113), so 30.0
    # would stop its own start-up: ftengine agrees instead of accepting it.
    with pytest.raises(
        ConfigError, match=r"ft_communication_abort_timeout .*found 30\.0.*write 30"
    ):
        NpuFtConfig.from_additional_config({"ft_communication_abort_timeout": 30.0})
    assert (
        NpuFtConfig.from_additional_config(
            {"ft_communication_abort_timeout": 30}
        ).communication_abort_timeout_s
        == 30
    )


def test_an_integral_float_is_accepted_by_the_backend_call(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    rig = make_npu_rig(index)
    rig.backend.set_op_timeout(45.0)
    assert rig.environ == {**FT_ENV, EVENT: "45", EXEC: "44"}
    assert npu_state.of("npu.set_op_timeout_ms")[-1] == Call("npu.set_op_timeout_ms", (45000,))
    with pytest.raises(ConfigError, match="whole number"):
        rig.backend.set_op_timeout(0.5)


@pytest.mark.parametrize(
    ("env", "seconds"),
    [
        ({EVENT: "10"}, 30),  # derived EXEC 29 >= user EVENT 10
        ({EXEC: "40"}, 30),  # derived EVENT 30 <= user EXEC 40
        ({EVENT: "5", EXEC: "5"}, 0),  # both set by the user, no T
        ({EVENT: "20", EXEC: "30"}, 60),  # both set by the user win over T
    ],
)
def test_event_must_outlast_exec(env: dict[str, str], seconds: int) -> None:
    with pytest.raises(ConfigError, match=f"{EVENT}=.* must be greater than {EXEC}="):
        plan_op_timeout(seconds, env)


def test_user_values_win_over_t_when_consistent() -> None:
    plan = plan_op_timeout(60, {EVENT: "40", EXEC: "20"})
    assert plan.env == {}
    assert (plan.event_timeout_s, plan.exec_timeout_s, plan.op_timeout_ms) == (40, 20, 60000)


@pytest.mark.parametrize("raw", ["abc", "1.5", "-3"])
def test_non_integer_hccl_values_are_rejected_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match=EXEC):
        plan_op_timeout(30, {EXEC: raw})


def test_reapplying_replaces_our_values_and_keeps_the_users(npu_state: FakeNpuState) -> None:
    env = {"HCCL_CONNECT_TIMEOUT": "120"}
    controller = OpTimeoutController(NpuRuntime.load(), env)
    controller.apply(30)
    controller.apply(10)
    assert env == {"HCCL_CONNECT_TIMEOUT": "120", EVENT: "10", EXEC: "9"}
    controller.apply(0)
    assert env == {"HCCL_CONNECT_TIMEOUT": "120"}
    calls = [call.args for call in npu_state.of("npu.set_op_timeout_ms")]
    # Off after on is torch_npu's own default (547 s), never 0.
    assert calls == [(30000,), (10000,), (TORCH_NPU_DEFAULT_OP_TIMEOUT_MS,)]
    assert TORCH_NPU_DEFAULT_OP_TIMEOUT_MS == 547_000


def test_a_variable_the_user_changed_after_us_is_theirs(npu_state: FakeNpuState) -> None:
    env: dict[str, str] = {}
    controller = OpTimeoutController(NpuRuntime.load(), env)
    controller.apply(30)
    env[EXEC] = "3"
    controller.apply(20)
    assert env == {EVENT: "20", EXEC: "3"}


def test_owned_gloo_groups_get_the_cpu_distributed_timeout(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    config = NpuFtConfig(cpu_distributed_timeout_s=30.0)
    rig = make_npu_rig(index, dp_size=1, config=config)
    rig.backend.groups.register("dp_sync")
    rig.backend.groups.register("mc2_side", backend="hccl")
    assert [(g.backend, g.timeout_s) for g in rig.groups.created] == [
        ("gloo", 30.0),
        ("hccl", None),
    ]


def test_a_torch_npu_before_7_3_runs_without_an_op_timeout(
    npu_state: FakeNpuState, index: CheckpointIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch_npu

    monkeypatch.delattr(torch_npu.npu, "set_op_timeout_ms")  # torch_npu 7.2
    rig = make_npu_rig(index, config=NpuFtConfig(communication_abort_timeout_s=0))
    assert rig.environ == FT_ENV
    with pytest.raises(TorchNpuUnavailable) as caught:
        make_npu_rig(index, config=NpuFtConfig(communication_abort_timeout_s=30))
    message = str(caught.value)
    assert "set_op_timeout_ms" in message and "torch_npu 7.3.0" in message
    assert "aclrtSetOpExecuteTimeOutV2" in message and "CANN" in message


def test_a_missing_op_timeout_changes_nothing(
    npu_state: FakeNpuState, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch_npu

    monkeypatch.delattr(torch_npu.npu, "set_op_timeout_ms")
    env = {"PATH": "/bin"}
    with pytest.raises(TorchNpuUnavailable, match="ft_communication_abort_timeout to 0"):
        OpTimeoutController(NpuRuntime.load(), env).apply(30)
    assert env == {"PATH": "/bin"}


def test_tp_2_also_turns_hccl_async_error_handling_off(
    npu_state: FakeNpuState, index: CheckpointIndex
) -> None:
    rig = make_npu_rig(index, dp_size=2, tp_size=2, num_redundant=4)
    assert rig.environ == {TASK_QUEUE: "0", ASYNC_ERRORS: "0", TORCH_ASYNC_ERRORS: "0"}


@pytest.mark.parametrize("name", [ASYNC_ERRORS, TORCH_ASYNC_ERRORS])
def test_async_error_handling_left_on_under_either_name_is_a_problem_and_overridden(
    name: str,
) -> None:
    env = {TASK_QUEUE: "0", ASYNC_ERRORS: "0", TORCH_ASYNC_ERRORS: "0", name: "1"}
    problems = ft_environment_problems(env, 2)
    assert len(problems) == 1 and problems[0].startswith(f"{name} is '1'")
    assert apply_ft_environment(env, 2) == {name: "1"}
    assert env == {TASK_QUEUE: "0", ASYNC_ERRORS: "0", TORCH_ASYNC_ERRORS: "0"}


def test_the_users_task_queue_is_overridden_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    env = {TASK_QUEUE: "2", ASYNC_ERRORS: "1"}
    assert ft_environment_problems(env, 2) != ()
    with caplog.at_level("WARNING"):
        replaced = apply_ft_environment(env, 2)
    assert replaced == {TASK_QUEUE: "2", ASYNC_ERRORS: "1"}
    assert env == {TASK_QUEUE: "0", ASYNC_ERRORS: "0", TORCH_ASYNC_ERRORS: "0"}
    assert "TASK_QUEUE_ENABLE=2 overridden to 0" in caplog.text
    assert ft_environment_problems(env, 2) == ()
    assert apply_ft_environment(env, 1) == {}  # TP = 1 leaves the async handling alone
    assert env[ASYNC_ERRORS] == "0"
