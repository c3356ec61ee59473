"""Measure one scale-down scenario end to end: plan, apply, elastic_info, scores, baseline.

Shared by ``ftengine plan`` and ``bench/bench_placement.py`` so both report the same
numbers the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from ftengine.errors import ConfigError
from ftengine.placement.apply import apply_plan
from ftengine.placement.elastic import ElasticInfo, elastic_info_values
from ftengine.placement.initial import make_placement
from ftengine.placement.loads import load_from_file, uniform_load, zipf_load
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.planner import RedistributionPlan, plan_redistribution
from ftengine.placement.rebalance import fresh_rebalance
from ftengine.placement.scoring import balancedness, zero_reload_bound, zero_reload_fraction


@attrs.frozen
class Scenario:
    """A model shape, an initial placement, a load and a cumulative set of dead EP ranks.

    ``load`` is ``"uniform"``, ``"zipf"`` (see ``loads.zipf_load``) or a file path.
    """

    layers: int
    experts: int
    ep: int
    redundant: int
    dead: frozenset[int]
    placement: str = "default"
    load: str = "uniform"
    extra_reloads: int = 0
    seed: int = 0
    zipf_exponent: float = 1.0
    top_k: int = 8


def build_load(scenario: Scenario) -> torch.Tensor:
    """The scenario's per-expert load, float64 ``[layers, experts]``."""
    if scenario.load == "uniform":
        return uniform_load(scenario.layers, scenario.experts)
    if scenario.load == "zipf":
        return zipf_load(
            scenario.layers,
            scenario.experts,
            exponent=scenario.zipf_exponent,
            seed=scenario.seed,
            top_k=min(scenario.top_k, scenario.experts),
        )
    path = Path(scenario.load)
    if not path.exists():
        raise ConfigError(
            f"--load {scenario.load!r}: expected 'uniform', 'zipf' or an existing file"
        )
    return load_from_file(path, scenario.layers, scenario.experts)


def median_ms(action: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``action`` in milliseconds over ``repeats`` runs."""
    samples = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def time_elastic_info(
    world: int, local_slots: int, dead: frozenset[int], repeats: int = 200
) -> tuple[float, bool]:
    """Median ``ElasticInfo.update`` time in microseconds, and whether it stayed in place."""
    info = ElasticInfo(world, local_slots)
    pointer = info.tensor.data_ptr()
    info.update(dead)
    micros = median_ms(lambda: info.update(dead), repeats) * 1e3
    expected = elastic_info_values(world, dead, local_slots)
    in_place = info.tensor.data_ptr() == pointer and info.tensor.tolist() == expected
    return micros, in_place


@attrs.frozen
class Report:
    """Everything measured for one scenario (``ftengine plan --json`` prints ``to_dict()``).

    Times are medians in ms (plan, apply) and microseconds (elastic_info). Balancedness is
    vLLM's ``sum mean / sum max`` of per-rank load over live ranks; ``*_before_failure``
    and the zero-reload scores describe the initial placement.
    """

    layers: int
    experts: int
    ep: int
    redundant: int
    local_slots: int
    dead: tuple[int, ...]
    placement: str
    load: str
    extra_reloads: int
    seed: int
    reloads: int
    reload_lower_bound: int
    extra_reloads_used: int
    balancedness_before_failure: float
    balancedness: float
    balancedness_fresh_rebalance: float
    balancedness_vs_fresh: float
    fresh_rebalance_reloads: int
    plan_ms: float
    apply_ms: float
    elastic_info_us: float
    elastic_info_in_place: bool
    maps_in_place: bool
    single_rank_zero_reload_fraction: float
    single_rank_zero_reload_bound: float
    two_rank_zero_reload_fraction: float
    two_rank_zero_reload_bound: float
    plan_digest: str

    def to_dict(self) -> dict[str, object]:
        """JSON-ready mapping of every field."""
        return attrs.asdict(self)


def evaluate(scenario: Scenario, *, repeats: int = 1) -> Report:
    """Run the scenario: plan, apply (in place), elastic_info, scores and the baseline."""
    load = build_load(scenario)
    placement = make_placement(
        scenario.placement,
        scenario.layers,
        scenario.experts,
        scenario.redundant,
        scenario.ep,
        load,
    )
    before = _balance(placement.physical_to_logical_map, load, placement, ())
    scores = _failure_scores(placement)
    plan, plan_ms = _time_plan(scenario, placement, load, repeats)
    fresh_p2l, fresh_reloads = fresh_rebalance(placement, scenario.dead, load)
    apply_ms, maps_in_place = _time_apply(placement, plan, repeats)
    placement.validate(require_every_expert=True)
    elastic_us, in_place = time_elastic_info(scenario.ep, placement.local_slots, scenario.dead)
    after = _balance(placement.physical_to_logical_map, load, placement, scenario.dead)
    fresh = _balance(fresh_p2l, load, placement, scenario.dead)
    return Report(
        layers=scenario.layers,
        experts=scenario.experts,
        ep=scenario.ep,
        redundant=scenario.redundant,
        local_slots=placement.local_slots,
        dead=tuple(sorted(scenario.dead)),
        placement=scenario.placement,
        load=scenario.load,
        extra_reloads=scenario.extra_reloads,
        seed=scenario.seed,
        reloads=plan.reloads,
        reload_lower_bound=plan.lower_bound,
        extra_reloads_used=plan.reloads - plan.lower_bound,
        balancedness_before_failure=before,
        balancedness=after,
        balancedness_fresh_rebalance=fresh,
        balancedness_vs_fresh=after / fresh if fresh > 0 else 0.0,
        fresh_rebalance_reloads=fresh_reloads,
        plan_ms=plan_ms,
        apply_ms=apply_ms,
        elastic_info_us=elastic_us,
        elastic_info_in_place=in_place,
        maps_in_place=maps_in_place,
        plan_digest=plan.digest(),
        **scores,
    )


def _failure_scores(placement: ExpertPlacement) -> dict[str, float]:
    shape = (placement.num_logical, placement.num_physical, placement.ep_size)
    return {
        "single_rank_zero_reload_fraction": zero_reload_fraction(placement, 1),
        "single_rank_zero_reload_bound": zero_reload_bound(*shape, 1),
        "two_rank_zero_reload_fraction": zero_reload_fraction(placement, 2),
        "two_rank_zero_reload_bound": zero_reload_bound(*shape, 2),
    }


def _balance(
    p2l: torch.Tensor,
    load: torch.Tensor,
    placement: ExpertPlacement,
    dead: frozenset[int] | tuple[()],
) -> float:
    return balancedness(
        p2l.cpu(),
        load,
        num_logical=placement.num_logical,
        local_slots=placement.local_slots,
        dead_ep_ranks=dead,
    )


def _time_plan(
    scenario: Scenario, placement: ExpertPlacement, load: torch.Tensor, repeats: int
) -> tuple[RedistributionPlan, float]:
    """The plan and its median planning time (after one untimed warm-up run)."""
    plan = plan_redistribution(
        placement, scenario.dead, load=load, extra_reloads=scenario.extra_reloads
    )
    elapsed = median_ms(
        lambda: plan_redistribution(
            placement, scenario.dead, load=load, extra_reloads=scenario.extra_reloads
        ),
        repeats,
    )
    return plan, elapsed


def _time_apply(
    placement: ExpertPlacement, plan: RedistributionPlan, repeats: int
) -> tuple[float, bool]:
    """Median apply time (copies, then ``placement`` itself) and whether storage was kept."""
    samples = [_apply_once(placement.clone(), plan) for _ in range(max(repeats - 1, 0))]
    pointers = _pointers(placement)
    samples.append(_apply_once(placement, plan))
    return statistics.median(samples), _pointers(placement) == pointers


def _apply_once(placement: ExpertPlacement, plan: RedistributionPlan) -> float:
    start = time.perf_counter()
    apply_plan(placement, plan)
    return (time.perf_counter() - start) * 1e3


def _pointers(placement: ExpertPlacement) -> tuple[int, int, int]:
    return (
        placement.physical_to_logical_map.data_ptr(),
        placement.logical_to_physical_map.data_ptr(),
        placement.logical_replica_count.data_ptr(),
    )
