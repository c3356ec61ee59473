"""The selective-reload benchmark: one DP worker re-hosting a dead rank's experts.

A checkpoint of about N MB is built (or reused); the placement planner
(``ftengine.placement``) plans the scale-down from vLLM's default placement after one
rank dies; the survivor with the most reloads (or the one asked for) is measured. Each
loader runs in a fresh child process (``reload_measure``) so their memory does not mix,
from a cold page cache (as after a real fault) and, for comparison, a warm one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from ftengine.errors import ConfigError, PlacementError
from ftengine.placement import ExpertPlacement, plan_redistribution
from ftengine.testbed.bench.reload_measure import (
    BenchError,
    Cache,
    ChildJob,
    ProgressFn,
    run_child,
)
from ftengine.weights.checkpoint_gen import (
    GENERATOR_KEY,
    ModelShape,
    WriteOptions,
    is_generated_checkpoint,
    write_checkpoint,
)
from ftengine.weights.index import CheckpointIndex, Quant
from ftengine.weights.reload import Assignment

__all__ = [
    "BenchError",
    "BenchSetup",
    "WorkerPlan",
    "plan_worker_reload",
    "prepare_checkpoint",
    "run_bench",
    "summarize",
]

COLD_CACHED_MAX = 0.05
"""Largest fraction of the shards still cached after an eviction that still counts as cold."""


@attrs.frozen
class BenchSetup:
    """What to build and measure; sizes default to DP=4 with 64 experts per layer and 32
    redundant slots, rank 1 lost.

    ``worker_rank`` None measures the survivor with the most reloads. ``caches`` are the
    page-cache states measured; the first is the headline, the others are reported beside.
    """

    size_mb: float
    quant: Quant = "none"
    dp: int = 4
    layers: int = 4
    experts: int = 64
    redundant: int = 32
    dead_rank: int = 1
    worker_rank: int | None = None
    workers: int = 1
    threads: int = 1
    repeat: int = 5
    shards: int = 4
    seed: int = 0
    caches: tuple[Cache, ...] = ("cold", "warm")

    @property
    def local_slots(self) -> int:
        """Slots per rank: (experts + redundant) / dp."""
        return (self.experts + self.redundant) // self.dp

    def model_shape(self) -> ModelShape:
        """H (a multiple of 64) and I = H / 2 so the experts total about ``size_mb``."""
        per_h2 = 1.5 if self.quant == "w8a8_dynamic" else 3.0  # bytes per H^2, bf16 / int8
        h = math.sqrt(self.size_mb * 2**20 / (self.layers * self.experts * per_h2))
        hidden = max(64, round(h / 64) * 64)
        return ModelShape(
            layers=self.layers,
            experts=self.experts,
            hidden=hidden,
            intermediate=hidden // 2,
            vocab=512,
            heads=4,
            kv_heads=2,
            head_dim=hidden // 4,
            top_k=2,
        )

    def write_options(self) -> WriteOptions:
        """How the benchmark's checkpoint is written (model dtype bfloat16, no manifest)."""
        return WriteOptions(quant=self.quant, shards=self.shards, seed=self.seed)


@attrs.frozen
class WorkerPlan:
    """The measured survivor: its EP rank, its experts before the fault and its reloads.

    Assignments are (layer, local slot, logical expert).
    """

    rank: int
    initial: tuple[Assignment, ...]
    reload: tuple[Assignment, ...]


def plan_worker_reload(setup: BenchSetup) -> WorkerPlan:
    """Plan the scale-down after ``dead_rank`` dies with the placement planner.

    Raises PlacementError if the measured worker is the dead rank, PreconditionFailed if
    the survivors cannot hold every expert.
    """
    placement = ExpertPlacement.default(setup.layers, setup.experts, setup.redundant, setup.dp)
    plan = plan_redistribution(placement, [setup.dead_rank])
    survivors = [r for r in range(setup.dp) if r != setup.dead_rank]
    rank = setup.worker_rank
    if rank is None:
        rank = max(survivors, key=lambda r: (len(plan.local_assignments(r)), -r))
    elif rank not in survivors:
        raise PlacementError(
            f"worker rank {rank} must survive the loss of rank {setup.dead_rank} "
            f"(survivors: {survivors}); pick another --worker-rank"
        )
    base = rank * setup.local_slots
    p2l = placement.physical_to_logical_map[:, base : base + setup.local_slots].tolist()
    initial = tuple(
        (layer, slot, int(expert))
        for layer, row in enumerate(p2l)
        for slot, expert in enumerate(row)
    )
    return WorkerPlan(rank, initial, plan.local_assignments(rank))


def prepare_checkpoint(
    setup: BenchSetup, root: Path, progress: Callable[[int, int], None] | None = None
) -> tuple[Path, bool]:
    """Build the checkpoint at ``root`` unless an identical one is there: (path, reused)."""
    shape, options = setup.model_shape(), setup.write_options()
    if root.exists() and any(root.iterdir()):
        if not is_generated_checkpoint(root):
            raise ConfigError(
                f"{root} is not empty and not an ftengine-generated checkpoint; refusing to "
                "overwrite it, pass an empty or new --checkpoint directory"
            )
        index = CheckpointIndex.open(root)
        built = (index.hidden_size, index.num_experts, index.num_layers)
        wanted = (shape.hidden, shape.experts, shape.layers)
        if index.config.get(GENERATOR_KEY) == options.generator_record() and built == wanted:
            return root, True
    write_checkpoint(root, shape, options, overwrite=True, progress=progress)
    return root, False


def _ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 4) if denominator else math.inf


def _timing(row: Mapping[str, Any], speedup_target: float) -> dict[str, Any]:
    """One cache state's times, their ratios and the two timing targets."""
    ratios = {
        "naive_over_reload_s": _ratio(row["naive_reload_s"], row["reload_s"]),
        "reload_over_raw_read_s": _ratio(row["reload_s"], row["raw_read_s"]),
        # What the storage allows: streaming every shard whole over the reload's own reads of
        # just the needed runs (no transform either side). On a disk where scattered runs
        # are slower per byte than one long stream, this is below the bytes ratio, and the
        # naive/selective speedup cannot exceed it by much.
        "storage_all_over_needed_s": _ratio(
            row["storage_all_read_s"], row["storage_needed_read_s"]
        ),
    }
    targets = {
        "speedup": ratios["naive_over_reload_s"] >= speedup_target,
        "reload_vs_raw_read": ratios["reload_over_raw_read_s"] <= 3.0,
    }
    return {**row, "ratios": ratios, "targets_met": targets}


def cache_label(cache: Cache, row: Mapping[str, Any]) -> tuple[Cache, str | None]:
    """The page-cache state a run really had, with a note when "cold" could not be had."""
    if cache == "warm":
        return "warm", None
    if not row.get("evicted", False):
        return "warm", "this OS cannot evict files from the page cache; measured warm"
    cached = row.get("cached_after_evict")
    if cached is not None and cached > COLD_CACHED_MAX:
        return "warm", (
            f"{cached:.0%} of the shards stayed cached after eviction (tmpfs, or mapped by "
            "another process); put the checkpoint on a disk-backed filesystem"
        )
    return "cold", None


def _describe(setup: BenchSetup, plan: WorkerPlan, index: CheckpointIndex) -> dict[str, Any]:
    """What was measured: the checkpoint, the model and DP sizes, the worker, the run knobs."""
    return {
        "bench": "reload",
        "checkpoint": str(index.path),
        "quant": index.quant,
        "size_mb": round(index.expert_bytes_total / 2**20, 1),
        "layers": setup.layers,
        "experts": setup.experts,
        "hidden": index.hidden_size,
        "intermediate": index.intermediate_size,
        "dp": setup.dp,
        "local_slots": setup.local_slots,
        "num_redundant": setup.redundant,
        "dead_rank": setup.dead_rank,
        "worker_rank": plan.rank,
        "workers": setup.workers,
        "torch_threads": setup.threads,
        "repeat": setup.repeat,
    }


def _headline(
    common: Mapping[str, Any], head: Mapping[str, Any], speedup_target: float
) -> tuple[dict[str, float], dict[str, bool]]:
    """The byte and memory ratios beside the headline cache state's timing ratios, and
    whether each target is met."""
    needed = common["bytes_needed"]
    ratios = {
        "bytes_read_over_needed": _ratio(common["bytes_read"], needed),
        "peak_rss_over_needed": _ratio(common["peak_rss_delta_bytes"], needed),
        "naive_peak_rss_over_needed": _ratio(common["naive_peak_rss_delta_bytes"], needed),
        "speedup_target": speedup_target,
        **head["ratios"],
    }
    if head.get("disk_read_bytes") is not None:
        # What the disk delivered, readahead included: only meaningful from a cold cache.
        ratios["disk_read_over_needed"] = _ratio(head["disk_read_bytes"], needed)
    targets = {
        "bytes_read": ratios["bytes_read_over_needed"] <= 1.02,
        "peak_rss": ratios["peak_rss_over_needed"] <= 1.2,
        **head["targets_met"],
    }
    return ratios, targets


def summarize(
    setup: BenchSetup,
    plan: WorkerPlan,
    index: CheckpointIndex,
    selective: Mapping[str, Any],
    naive: Mapping[str, Any],
) -> dict[str, Any]:
    """The benchmark's JSON object: measurements, their target ratios and whether each
    is met.

    Headline fields are for the first of ``setup.caches``; each other cache state gets a
    sub-object (e.g. ``warm``) with its times, ratios and timing targets, and ``compare``
    puts the timing ratios of every state side by side.
    """
    common = {**selective["common"], **naive["common"]}
    total, needed = index.expert_bytes_total, common["bytes_needed"]
    target = round(0.8 * total / needed, 4) if needed else math.inf
    rows = {
        cache: _timing({**selective["by_cache"][cache], **naive["by_cache"][cache]}, target)
        for cache in setup.caches
    }
    head = rows[setup.caches[0]]
    label, note = cache_label(setup.caches[0], head)
    ratios, targets = _headline(common, head, target)
    return {
        **_describe(setup, plan, index),
        "cache": label,
        **({"cache_note": note} if note else {}),
        "expert_bytes_total": total,
        **common,
        **{k: v for k, v in head.items() if k not in ("ratios", "targets_met")},
        "matches_naive": selective["slot_digest"] == naive["slot_digest"],
        "ratios": ratios,
        "targets_met": targets,
        **{cache: row for cache, row in rows.items() if cache != setup.caches[0]},
        "compare": {
            key: {cache: row["ratios"][key] for cache, row in rows.items()}
            for key in head["ratios"]
        },
    }


def run_bench(
    setup: BenchSetup,
    root: Path,
    *,
    timeout_s: float = 900.0,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Build or reuse the checkpoint at ``root``, measure both loaders, return the summary."""

    def writing(done: int, total: int) -> None:
        if progress is not None:
            progress("writing checkpoint", done, total)

    plan = plan_worker_reload(setup)
    if not plan.reload:
        raise BenchError(
            f"losing rank {setup.dead_rank} gives rank {plan.rank} nothing to reload "
            "(every expert keeps a replica or lands elsewhere); pick another --dead-rank "
            "or --worker-rank"
        )
    path, reused = prepare_checkpoint(setup, root, writing)
    index = CheckpointIndex.open(path)
    results: dict[str, dict[str, Any]] = {}
    modes: tuple[Literal["selective", "naive"], ...] = ("selective", "naive")
    for mode in modes:
        job = ChildJob(
            mode=mode,
            path=str(path),
            layers=setup.layers,
            local_slots=setup.local_slots,
            initial=plan.initial,
            reload=plan.reload,
            caches=setup.caches,
            workers=setup.workers,
            threads=setup.threads,
            repeat=setup.repeat,
        )
        results[mode] = run_child(job, timeout_s, progress)
    summary = summarize(setup, plan, index, results["selective"], results["naive"])
    return {**summary, "reused_checkpoint": reused}
