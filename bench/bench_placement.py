"""Placement benchmark: every issue-3 target, measured, printed as one JSON object.

Run: ``.venv/bin/python bench/bench_placement.py`` (about a minute on 2 busy cores).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from ftengine.placement.evaluate import Scenario, build_load, evaluate
from ftengine.placement.initial import make_placement
from ftengine.placement.planner import plan_redistribution
from ftengine.placement.scoring import balancedness, zero_reload_bound, zero_reload_fraction

LAYERS, EXPERTS = 61, 256
SMALL = {"ep": 32, "redundant": 32, "dead": frozenset({3, 17})}
LARGE = {"ep": 256, "redundant": 256, "dead": frozenset(range(7, 256, 16))}


def _target(value: float, op: str, bound: float) -> dict[str, object]:
    met = value <= bound if op == "<=" else value >= bound
    return {"value": value, "target": f"{op} {bound}", "met": met}


def speed() -> dict[str, object]:
    """Plan + apply <= 100 ms and elastic_info rebuild <= 100 us at both sizes."""
    out: dict[str, object] = {}
    for name, shape in (("ep32_r32_2dead", SMALL), ("ep256_r256_16dead", LARGE)):
        for placement in ("default", "balanced"):
            load = "uniform" if placement == "default" else "zipf"
            scenario = Scenario(LAYERS, EXPERTS, placement=placement, load=load, **shape)
            report = evaluate(scenario, repeats=7)
            total = float(report["plan_ms"]) + float(report["apply_ms"])  # type: ignore[arg-type]
            out[f"{name}_{placement}_{load}"] = {
                "plan_ms": report["plan_ms"],
                "apply_ms": report["apply_ms"],
                "plan_plus_apply_ms": _target(total, "<=", 100.0),
                "elastic_info_us": _target(float(report["elastic_info_us"]), "<=", 100.0),  # type: ignore[arg-type]
                "elastic_info_in_place": report["elastic_info_in_place"],
                "maps_in_place": report["maps_in_place"],
                "reloads": report["reloads"],
                "reload_lower_bound": report["reload_lower_bound"],
            }
    return out
