"""The selective-reload benchmark: one DP worker re-hosting a dead rank's experts.

A checkpoint of about N MB is built (or reused); a DP=4 worker's slot storage is filled
with its initial experts; the reload plan for one dead rank is computed (vLLM's rule,
REFERENCE §3: each expert left without a replica takes a spare slot, round-robin over the
survivors); then, each in a fresh child process so their memory does not mix, the
selective reload (plus a raw read of the same tensors) and the naive "load every expert,
then select" baseline are timed and their peak RSS measured.
"""

from __future__ import annotations

import gc
import hashlib
import math
import multiprocessing
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open

from ftengine.errors import ConfigError, FTEngineError, PlacementError
from ftengine.weights.checkpoint_gen import (
    GENERATOR_KEY,
    ModelShape,
    is_generated_checkpoint,
    make_checkpoint,
)
from ftengine.weights.index import CheckpointIndex, Quant
from ftengine.weights.peak_rss import PeakRss
from ftengine.weights.reload import Assignment, load_experts_into_slots
from ftengine.weights.slots import ExpertSlots, SlotWeights

ProgressFn = Callable[[str, int, int], None]
"""Called with (phase, bytes done, bytes total)."""


@attrs.frozen
class BenchSetup:
    """What to build and measure; sizes default to the issue's DP=4 scenario."""

    size_mb: float
    quant: Quant = "none"
    dp: int = 4
    layers: int = 4
    experts: int = 64
    redundant: int = 32
    dead_rank: int = 1
    worker_rank: int = 0
    workers: int = 1
    threads: int = 1
    repeat: int = 5
    shards: int = 4
    seed: int = 0

    @property
    def local_slots(self) -> int:
        """Slots per rank: (experts + redundant) / dp."""
        return (self.experts + self.redundant) // self.dp

    def model_shape(self) -> ModelShape:
        """H (a multiple of 64) and I = H / 2 so the experts total about ``size_mb``."""
        per_h2 = 1.5 if self.quant == "w8a8_dynamic" else 3.0  # bytes per H^2, bf16 / int8
        h = math.sqrt(self.size_mb * 2**20 / (self.layers * self.experts * per_h2))
        hidden = max(64, round(h / 64) * 64)
        return ModelShape(self.layers, self.experts, hidden, hidden // 2, 512, 4, 2, hidden // 4, 2)


def plan_worker_reload(setup: BenchSetup) -> tuple[list[Assignment], list[Assignment]]:
    """(initial assignments of the worker, reload assignments after ``dead_rank`` dies)."""
    e, slots, ep = setup.experts, setup.local_slots, setup.dp
    if (e + setup.redundant) % ep or not 0 <= setup.dead_rank < ep:
        raise PlacementError(f"need (experts + redundant) % dp == 0 and a dead rank < dp: {setup}")
    row = list(range(e)) + [i % e for i in range(setup.redundant)]
    alive = [r for r in range(ep) if r != setup.dead_rank]
    if setup.worker_rank not in alive:
        raise PlacementError(f"worker rank {setup.worker_rank} must survive, dead: {setup}")
    live = [p for p in range(len(row)) if p // slots != setup.dead_rank]
    counts = [sum(1 for p in live if row[p] == x) for x in range(e)]
    orphans = [x for x in range(e) if counts[x] == 0]
    moves: dict[int, int] = {}
    for p in sorted(live, key=lambda p: (p % slots, alive.index(p // slots))):
        if orphans and counts[row[p]] > 1:
            counts[row[p]] -= 1
            moves[p] = orphans.pop(0)
    if orphans:
        raise PlacementError(f"not enough spare slots for experts {orphans}: {setup}")
    base = setup.worker_rank * slots
    initial = [(lay, s, row[base + s]) for lay in range(setup.layers) for s in range(slots)]
    mine = [(p - base, x) for p, x in sorted(moves.items()) if p // slots == setup.worker_rank]
    reload = [(lay, s, x) for lay in range(setup.layers) for s, x in mine]
    return initial, reload


def prepare_checkpoint(
    setup: BenchSetup, root: Path, progress: Callable[[int, int], None] | None = None
) -> tuple[Path, bool]:
    """Build the checkpoint at ``root`` unless an identical one is there: (path, reused)."""
    shape = setup.model_shape()
    wanted = {"seed": setup.seed, "quant": setup.quant, "shards": setup.shards, "manifest": False}
    if root.exists() and any(root.iterdir()):
        if not is_generated_checkpoint(root):
            raise ConfigError(
                f"{root} is not empty and not an ftengine-generated checkpoint; refusing to "
                "overwrite it, pass an empty or new --checkpoint directory"
            )
        index = CheckpointIndex.open(root)
        built = (index.hidden_size, index.num_experts, index.num_layers)
        if index.config.get(GENERATOR_KEY) == wanted and built == (
            shape.hidden,
            shape.experts,
            shape.layers,
        ):
            return root, True
    make_checkpoint(
        root,
        layers=shape.layers,
        experts=shape.experts,
        hidden=shape.hidden,
        intermediate=shape.intermediate,
        quant=setup.quant,
        shards=setup.shards,
        seed=setup.seed,
        vocab=shape.vocab,
        head_dim=shape.head_dim,
        overwrite=True,
        progress=progress,
    )
    return root, False


def warm_page_cache(index: CheckpointIndex, chunk: int = 16 * 2**20) -> None:
    """Read every shard once in chunks so all measured runs start from a warm page cache."""
    for file in index.files:
        with file.open("rb") as fh:
            while fh.read(chunk):
                pass


def _slot_digest(slots: ExpertSlots) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(slots.tensors().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def raw_read(index: CheckpointIndex, names: Iterable[str]) -> int:
    """Plain safetensors read of ``names`` into fresh memory, no transform; returns bytes."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(index.info(name).file, []).append(name)
    total = 0
    for file, wanted in sorted(by_file.items()):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            # clone(): with the mmap backend get_tensor alone reads nothing.
            loaded = [handle.get_tensor(name).clone() for name in wanted]
            total += sum(t.nbytes for t in loaded)
            del loaded
    return total


def naive_reload(
    index: CheckpointIndex,
    slots: ExpertSlots,
    assignments: list[Assignment],
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """The seed's first version: load every expert to host memory, then pick the needed ones."""
    everything: dict[str, torch.Tensor] = {}
    total, done = index.expert_bytes_total, 0
    for file in sorted(index.files):
        names = [n for n in index.experts.values() if index.tensors[n].file == file]
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in names:
                everything[name] = handle.get_tensor(name).clone()
                done += everything[name].nbytes
                if progress is not None:
                    progress(done, total)
    fields = {"gate_proj": "gate", "up_proj": "up", "gate_up_proj": "gate", "down_proj": "down"}
    suffixes = {"weight": "", "weight_scale": "_scale", "weight_offset": "_offset"}
    for layer, slot, expert in assignments:
        parts: dict[str, Any] = {}
        for (lay, exp, proj, param), name in index.experts.items():
            if (lay, exp) == (layer, expert):
                parts[fields[proj] + suffixes[param]] = everything[name]
        slots.write_slot(layer, slot, SlotWeights(**parts))


class BenchError(FTEngineError, RuntimeError):
    """A benchmark child process failed or ran past its time limit."""


def _needed_names(index: CheckpointIndex, assignments: list[Assignment]) -> list[str]:
    wanted = {(layer, expert) for layer, _, expert in assignments}
    return sorted(name for key, name in index.experts.items() if key[:2] in wanted)


def _throttled(conn: Connection, phase: str) -> Callable[[int, int], None]:
    last = [0.0]

    def send(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.1 or done >= total:
            last[0] = now
            conn.send(("progress", phase, done, total))

    return send


def _measure_selective(
    index: CheckpointIndex,
    slots: ExpertSlots,
    reload: list[Assignment],
    setup: BenchSetup,
    conn: Connection,
) -> dict[str, Any]:
    before = slots.data_ptrs()
    with PeakRss() as meter:
        first = load_experts_into_slots(
            index, slots, reload, workers=setup.workers, progress=_throttled(conn, "reload")
        )
    names = _needed_names(index, reload)
    raw_times = []
    for _ in range(setup.repeat):
        started = time.perf_counter()
        raw_read(index, names)
        raw_times.append(time.perf_counter() - started)
    times, serial = [first.seconds], []
    for _ in range(setup.repeat - 1):
        times.append(load_experts_into_slots(index, slots, reload, workers=setup.workers).seconds)
    for _ in range(setup.repeat):
        serial.append(load_experts_into_slots(index, slots, reload, workers=1).seconds)
    return {
        "experts_reloaded": first.experts,
        "bytes_needed": first.bytes_needed,
        "bytes_read": first.bytes_read,
        "peak_rss_delta_bytes": meter.delta,
        "rss_method": meter.method,
        "reload_s": min(times),
        "reload_serial_s": min(serial),
        "raw_read_s": min(raw_times),
        "in_place": before == slots.data_ptrs(),
    }


def _measure_naive(
    index: CheckpointIndex,
    slots: ExpertSlots,
    reload: list[Assignment],
    setup: BenchSetup,
    conn: Connection,
) -> dict[str, Any]:
    times = []
    with PeakRss() as meter:
        started = time.perf_counter()
        naive_reload(index, slots, reload, progress=_throttled(conn, "naive load"))
        times.append(time.perf_counter() - started)
    for _ in range(setup.repeat - 1):
        gc.collect()
        started = time.perf_counter()
        naive_reload(index, slots, reload)
        times.append(time.perf_counter() - started)
    return {"naive_peak_rss_delta_bytes": meter.delta, "naive_reload_s": min(times)}


def _child(mode: str, setup_fields: dict[str, Any], path: str, conn: Connection) -> None:
    """Child-process entry: fill the worker's slots, then measure ``mode``; report on ``conn``."""
    try:
        setup = BenchSetup(**setup_fields)
        # One intra-op thread by default: on a shared host an OpenMP team waiting for a busy
        # core distorts small copies by orders of magnitude; all three loaders get the same.
        torch.set_num_threads(setup.threads)
        index = CheckpointIndex.open(path)
        initial, reload = plan_worker_reload(setup)
        slots = ExpertSlots.allocate(index, setup.layers, setup.local_slots)
        load_experts_into_slots(index, slots, initial, progress=_throttled(conn, "initial load"))
        gc.collect()
        measure = _measure_selective if mode == "selective" else _measure_naive
        result = measure(index, slots, reload, setup, conn)
        result["slot_digest"] = _slot_digest(slots)
        conn.send(("result", result))
    except BaseException as exc:  # the parent re-raises it with the child's story
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def run_child(
    mode: str, setup: BenchSetup, path: Path, timeout_s: float, progress: ProgressFn | None
) -> dict[str, Any]:
    """Run one measurement in a fresh spawned process; kill it (by pid) past ``timeout_s``."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(mode, attrs.asdict(setup), str(path), sender))
    child.start()
    sender.close()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not receiver.poll(0.1):
                if not child.is_alive() and not receiver.poll(0):
                    raise BenchError(f"{mode} child exited with code {child.exitcode}")
                continue
            message = receiver.recv()
            if message[0] == "progress":
                if progress is not None:
                    progress(message[1], message[2], message[3])
            elif message[0] == "error":
                raise BenchError(f"{mode} child failed: {message[1]}")
            else:
                return dict(message[1])
        raise BenchError(f"{mode} child ran past {timeout_s:.0f} s; raise --timeout")
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()


def _ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 4) if denominator else math.inf


def summarize(
    setup: BenchSetup, index: CheckpointIndex, selective: dict[str, Any], naive: dict[str, Any]
) -> dict[str, Any]:
    """The benchmark's JSON object: measurements, the issue's ratios and whether each is met."""
    total, needed = index.expert_bytes_total, selective["bytes_needed"]
    ratios = {
        "bytes_read_over_needed": _ratio(selective["bytes_read"], needed),
        "peak_rss_over_needed": _ratio(selective["peak_rss_delta_bytes"], needed),
        "naive_peak_rss_over_needed": _ratio(naive["naive_peak_rss_delta_bytes"], needed),
        "naive_over_reload_s": _ratio(naive["naive_reload_s"], selective["reload_s"]),
        "speedup_target": round(0.8 * total / needed, 4) if needed else math.inf,
        "reload_over_raw_read_s": _ratio(selective["reload_s"], selective["raw_read_s"]),
    }
    targets = {
        "bytes_read": ratios["bytes_read_over_needed"] <= 1.02,
        "peak_rss": ratios["peak_rss_over_needed"] <= 1.2,
        "speedup": ratios["naive_over_reload_s"] >= ratios["speedup_target"],
        "reload_vs_raw_read": ratios["reload_over_raw_read_s"] <= 3.0,
    }
    return {
        "bench": "reload",
        "checkpoint": str(index.path),
        "quant": index.quant,
        "size_mb": round(total / 2**20, 1),
        "layers": setup.layers,
        "experts": setup.experts,
        "hidden": index.hidden_size,
        "intermediate": index.intermediate_size,
        "dp": setup.dp,
        "local_slots": setup.local_slots,
        "num_redundant": setup.redundant,
        "dead_rank": setup.dead_rank,
        "worker_rank": setup.worker_rank,
        "workers": setup.workers,
        "torch_threads": setup.threads,
        "repeat": setup.repeat,
        "expert_bytes_total": total,
        **{k: v for k, v in selective.items() if k != "slot_digest"},
        **{k: v for k, v in naive.items() if k != "slot_digest"},
        "matches_naive": selective["slot_digest"] == naive["slot_digest"],
        "ratios": ratios,
        "targets_met": targets,
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

    if not plan_worker_reload(setup)[1]:
        raise BenchError(
            f"losing rank {setup.dead_rank} gives rank {setup.worker_rank} nothing to reload "
            "(every expert keeps a replica or lands elsewhere); pick another --dead-rank"
        )
    path, reused = prepare_checkpoint(setup, root, writing)
    index = CheckpointIndex.open(path)
    warm_page_cache(index)
    selective = run_child("selective", setup, path, timeout_s, progress)
    naive = run_child("naive", setup, path, timeout_s, progress)
    return {**summarize(setup, index, selective, naive), "reused_checkpoint": reused}
