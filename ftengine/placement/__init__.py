"""Expert placement: EPLB maps, dead-rank redistribution, MC2 elastic_info."""

from ftengine.placement.apply import apply_plan
from ftengine.placement.elastic import ElasticInfo, densify_routing_ids, elastic_info_values
from ftengine.placement.initial import (
    PLACEMENTS,
    balanced_placement,
    default_placement,
    failure_aware_placement,
    make_placement,
)
from ftengine.placement.maps import ExpertPlacement
from ftengine.placement.planner import RedistributionPlan, SlotMove, plan_redistribution
from ftengine.placement.ranks import DeadRankSet, dp_to_ep_ranks, neutralize_dead_columns
from ftengine.placement.scoring import balancedness, zero_reload_bound, zero_reload_fraction

__all__ = [
    "PLACEMENTS",
    "DeadRankSet",
    "ElasticInfo",
    "ExpertPlacement",
    "RedistributionPlan",
    "SlotMove",
    "apply_plan",
    "balanced_placement",
    "balancedness",
    "default_placement",
    "densify_routing_ids",
    "dp_to_ep_ranks",
    "elastic_info_values",
    "failure_aware_placement",
    "make_placement",
    "neutralize_dead_columns",
    "plan_redistribution",
    "zero_reload_bound",
    "zero_reload_fraction",
]
