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
class Timings:
    """Medians of plan and apply (ms) and the elastic_info rebuild (µs), and whether the
    expert maps and the elastic_info tensor kept their storage."""

    plan_ms: float
    apply_ms: float
    elastic_info_us: float
    elastic_info_in_place: bool
    maps_in_place: bool


@attrs.frozen
class Balance:
    """vLLM's balancedness (``sum mean / sum max`` of per-rank load over live ranks) before
    the failure, after the plan and after a fresh rebalance, with that rebalance's reloads."""

    balancedness_before_failure: float
    balancedness: float
    balancedness_fresh_rebalance: float
    fresh_rebalance_reloads: int

    @property
    def balancedness_vs_fresh(self) -> float:
        """The plan's balancedness as a fraction of the fresh rebalance's."""
        fresh = self.balancedness_fresh_rebalance
        return self.balancedness / fresh if fresh > 0 else 0.0


@attrs.frozen
class FailureScores:
    """Of the initial placement: fractions of 1- and 2-rank failures needing no reload,
    next to the best any placement of that shape can reach."""

    single_rank_zero_reload_fraction: float
    single_rank_zero_reload_bound: float
    two_rank_zero_reload_fraction: float
    two_rank_zero_reload_bound: float

    @classmethod
    def of(cls, placement: ExpertPlacement) -> FailureScores:
        """Score ``placement`` as it is now."""
        shape = (placement.num_logical, placement.num_physical, placement.ep_size)
        return cls(
            zero_reload_fraction(placement, 1),
            zero_reload_bound(*shape, 1),
            zero_reload_fraction(placement, 2),
            zero_reload_bound(*shape, 2),
        )


# Only these two Scenario fields stay out of the report: they merely shape a zipf load,
# which the report already names with its seed.
_NOT_REPORTED = (attrs.fields(Scenario).zipf_exponent, attrs.fields(Scenario).top_k)


@attrs.frozen
class Report:
    """Everything measured for one scenario (``ftengine plan --json`` prints ``to_dict()``)."""

    scenario: Scenario
    local_slots: int
    plan: RedistributionPlan
    balance: Balance
    timings: Timings
    failure: FailureScores

    def to_dict(self) -> dict[str, object]:
        """JSON-ready flat mapping: the scenario, then every measurement."""
        plan = self.plan
        inputs = attrs.asdict(self.scenario, filter=attrs.filters.exclude(*_NOT_REPORTED))
        return {
            **inputs,
            "dead": sorted(self.scenario.dead),
            "local_slots": self.local_slots,
            "reloads": plan.reloads,
            "reload_lower_bound": plan.lower_bound,
            "extra_reloads_used": plan.reloads - plan.lower_bound,
            **attrs.asdict(self.balance),
            "balancedness_vs_fresh": self.balance.balancedness_vs_fresh,
            **attrs.asdict(self.timings),
            **attrs.asdict(self.failure),
            "plan_digest": plan.digest(),
        }


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
    failure = FailureScores.of(placement)
    before = _balance(placement.physical_to_logical_map, load, placement, frozenset())
    plan, plan_ms = _time_plan(scenario, placement, load, repeats)
    fresh_p2l, fresh_reloads = fresh_rebalance(placement, scenario.dead, load)
    apply_ms, maps_in_place = _time_apply(placement, plan, repeats)
    placement.validate(require_every_expert=True)
    elastic_us, in_place = time_elastic_info(scenario.ep, placement.local_slots, scenario.dead)
    balance = Balance(
        balancedness_before_failure=before,
        balancedness=_balance(placement.physical_to_logical_map, load, placement, scenario.dead),
        balancedness_fresh_rebalance=_balance(fresh_p2l, load, placement, scenario.dead),
        fresh_rebalance_reloads=fresh_reloads,
    )
    timings = Timings(plan_ms, apply_ms, elastic_us, in_place, maps_in_place)
    return Report(scenario, placement.local_slots, plan, balance, timings, failure)


def _balance(
    p2l: torch.Tensor,
    load: torch.Tensor,
    placement: ExpertPlacement,
    dead: frozenset[int],
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
