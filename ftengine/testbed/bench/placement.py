"""Placement benchmark: plan + apply time, elastic_info rebuild time, balancedness against
reloads and failure-aware zero-reload fractions, each beside its target, as one JSON object.

Run: ``ftengine bench placement`` or ``python bench/bench_placement.py`` (a minute or two
on 2 busy cores).
Each target is ``{"value", "target", "met"}``; ``environment`` says how busy the host was.
"""

from __future__ import annotations

import json
import os
import sys

import attrs
import torch

from ftengine.placement.apply import apply_plan
from ftengine.placement.evaluate import Scenario, build_load, evaluate
from ftengine.placement.initial import make_placement
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.planner import plan_redistribution
from ftengine.placement.rebalance import fresh_rebalance
from ftengine.placement.scoring import balancedness

LAYERS, EXPERTS = 61, 256
SMALL = Scenario(LAYERS, EXPERTS, ep=32, redundant=32, dead=frozenset({3, 17}))
LARGE = Scenario(LAYERS, EXPERTS, ep=256, redundant=256, dead=frozenset(range(7, 256, 16)))


def _target(value: float, op: str, bound: float) -> dict[str, object]:
    met = value <= bound if op == "<=" else value >= bound
    return {"value": round(value, 4), "target": f"{op} {bound}", "met": met}


def speed() -> dict[str, object]:
    """Plan + apply <= 100 ms and elastic_info rebuild <= 100 us, both sizes, two loads."""
    out: dict[str, object] = {}
    for name, base in (("ep32_r32_2dead", SMALL), ("ep256_r256_16dead", LARGE)):
        for placement, load in (("default", "uniform"), ("balanced", "zipf")):
            report = evaluate(attrs.evolve(base, placement=placement, load=load), repeats=7)
            times = report.timings
            out[f"{name}_{placement}_{load}"] = {
                "plan_ms": round(times.plan_ms, 2),
                "apply_ms": round(times.apply_ms, 2),
                "plan_plus_apply_ms": _target(times.plan_ms + times.apply_ms, "<=", 100.0),
                "elastic_info_us": _target(times.elastic_info_us, "<=", 100.0),
                "elastic_info_in_place": times.elastic_info_in_place,
                "maps_in_place": times.maps_in_place,
                "reloads": report.plan.reloads,
                "reload_lower_bound": report.plan.lower_bound,
                "balancedness": round(report.balance.balancedness, 4),
            }
    return out


def balance_curve(top_k: int, exponent: float = 1.0) -> dict[str, object]:
    """From a balanced placement under zipf load: balancedness against reloads.

    Points run from the lower bound (extra 0) up to the fresh rebalance's reload count.
    """
    scenario = attrs.evolve(
        SMALL, placement="balanced", load="zipf", top_k=top_k, zipf_exponent=exponent
    )
    load = build_load(scenario)
    placement = make_placement("balanced", LAYERS, EXPERTS, scenario.redundant, scenario.ep, load)
    fresh_p2l, fresh_reloads = fresh_rebalance(placement, scenario.dead, load)
    fresh = _balance(fresh_p2l, load, placement.local_slots, scenario.dead)
    lower = plan_redistribution(placement, scenario.dead, load=load).lower_bound
    extras = sorted({0, lower // 2, lower, 2 * lower, 4 * lower, fresh_reloads - lower})
    points = [_curve_point(placement, scenario.dead, load, extra, fresh) for extra in extras]
    at_bound = next(point for point in points if point["extra_reloads"] == 0)
    at_double = next(point for point in points if point["extra_reloads"] == lower)
    return {
        "load": f"zipf exponent {exponent}, top-{top_k} routing, seed 0",
        "reload_lower_bound": lower,
        "fresh_rebalance_reloads": fresh_reloads,
        "balancedness_fresh_rebalance": round(fresh, 4),
        "default_reloads_at_lower_bound": at_bound["reloads"] == lower,
        "twice_lower_bound_vs_fresh": _target(at_double["vs_fresh"], ">=", 0.95),
        "curve": points,
    }


def _curve_point(
    placement: ExpertPlacement,
    dead: frozenset[int],
    load: torch.Tensor,
    extra: int,
    fresh: float,
) -> dict[str, float]:
    plan = plan_redistribution(placement, dead, load=load, extra_reloads=extra)
    after = placement.clone()
    apply_plan(after, plan)
    value = _balance(after.physical_to_logical_map, load, placement.local_slots, dead)
    return {
        "extra_reloads": extra,
        "reloads": plan.reloads,
        "balancedness": round(value, 4),
        "vs_fresh": round(value / fresh, 4),
    }


def _balance(p2l: torch.Tensor, load: torch.Tensor, local: int, dead: frozenset[int]) -> float:
    return balancedness(p2l, load, num_logical=EXPERTS, local_slots=local, dead_ep_ranks=dead)


def failure_aware() -> dict[str, object]:
    """Zero-reload fractions of k-rank failures: failure-aware vs vLLM's default placement."""
    out: dict[str, object] = {}
    for redundant in (256, 32):
        rows: dict[str, object] = {}
        for kind in ("failure-aware", "default", "balanced"):
            scenario = Scenario(
                LAYERS, EXPERTS, ep=32, redundant=redundant, dead=frozenset({3}), placement=kind
            )
            report = evaluate(scenario)
            scores = attrs.asdict(report.failure)
            rows[kind] = {
                **{key: round(value, 4) for key, value in scores.items()},
                "reloads_when_rank_3_dies": report.plan.reloads,
            }
        out[f"ep32_r{redundant}"] = rows
    big = _row(out["ep32_r256"], "failure-aware")
    small = _row(out["ep32_r32"], "failure-aware")
    default = _row(out["ep32_r32"], "default")
    out["targets"] = {
        "ep32_r256_every_single_failure_zero_reload": _target(
            big["single_rank_zero_reload_fraction"], ">=", 1.0
        ),
        "ep32_r32_reaches_bound": _target(
            small["single_rank_zero_reload_fraction"],
            ">=",
            small["single_rank_zero_reload_bound"],
        ),
        "ep32_r32_beats_default": _target(
            small["single_rank_zero_reload_fraction"] - default["single_rank_zero_reload_fraction"],
            ">=",
            1e-9,
        ),
    }
    return out


def _row(table: object, kind: str) -> dict[str, float]:
    assert isinstance(table, dict)
    row = table[kind]
    assert isinstance(row, dict)
    return {key: float(value) for key, value in row.items()}


def run_placement() -> int:
    """Run every benchmark and print one JSON object."""
    report = {
        "environment": {
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "torch_threads": torch.get_num_threads(),
        },
        "speed": speed(),
        "balance_top8_zipf": balance_curve(top_k=8),
        "balance_raw_zipf_stress": balance_curve(top_k=1),
        "failure_aware": failure_aware(),
    }
    json.dump(report, sys.stdout)
    print()
    return 0
