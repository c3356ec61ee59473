"""The reload benchmark's measurements, each run in a fresh child process.

A child fills one worker's slot storage with its initial experts, then times one loader
(the selective reload plus a raw read of the same tensors, or the naive "load every
expert, then select" baseline) under each requested page-cache state: "cold" evicts the
shards before every timed run, as after a real fault; "warm" reads them into the page
cache first. Peak RSS is measured on the first timed run; the best time of each counts.
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import attrs
import torch
from safetensors import safe_open

from ftengine.errors import FTEngineError
from ftengine.testbed.bench.page_cache import cached_fraction, disk_read_bytes, evict
from ftengine.testbed.bench.peak_rss import PeakRss
from ftengine.weights.index import CheckpointIndex
from ftengine.weights.range_reader import RangeReader
from ftengine.weights.reload import Assignment, ReloadStats, load_experts_into_slots
from ftengine.weights.shard_reader import CHUNK_BYTES, chunked
from ftengine.weights.slots import ExpertSlots, SlotWeights

Cache = Literal["cold", "warm"]
ProgressFn = Callable[[str, int, int], None]
"""Called with (phase, bytes done, bytes total)."""


class BenchError(FTEngineError, RuntimeError):
    """A benchmark child process failed or ran past its time limit."""


class ChildTraceback(FTEngineError):
    """The formatted traceback of an error raised in a benchmark child process.

    Exceptions do not cross processes intact, so the parent's BenchError carries this as
    its ``__cause__`` to keep the child's story.
    """


@attrs.frozen
class ChildJob:
    """One child's work: which loader, on which checkpoint, for which slots, how often."""

    mode: Literal["selective", "naive"]
    path: str
    layers: int
    local_slots: int
    initial: tuple[Assignment, ...]
    reload: tuple[Assignment, ...]
    caches: tuple[Cache, ...] = ("cold", "warm")
    workers: int = 1
    threads: int = 1
    repeat: int = 5


def warm_page_cache(files: Iterable[Path], chunk: int = 16 * 2**20) -> None:
    """Read every file once in chunks so the runs after it find them in the page cache."""
    for file in files:
        with file.open("rb") as fh:
            while fh.read(chunk):
                pass


class CachePrep:
    """Puts the shards into one page-cache state before each timed run.

    ``cold``: evict (fsync + DONTNEED) every shard, then record how much stayed cached;
    ``warm``: read every shard once, on first use. ``evicted`` is False where the OS cannot
    evict; ``worst_cached`` is the largest cached fraction seen after an eviction (None
    when mincore is unavailable).
    """

    def __init__(self, files: Sequence[Path], cache: Cache) -> None:
        self.files = list(files)
        self.cache = cache
        self.evicted = True
        self.worst_cached: float | None = None
        self._warmed = False

    def __call__(self) -> None:
        if self.cache == "warm":
            if not self._warmed:
                warm_page_cache(self.files)
                self._warmed = True
            return
        self.evicted = evict(self.files) and self.evicted
        cached = cached_fraction(self.files)
        if cached is not None:
            self.worst_cached = max(cached, self.worst_cached or 0.0)

    def report(self) -> dict[str, Any]:
        """What the eviction achieved, for the summary."""
        return {"evicted": self.evicted, "cached_after_evict": self.worst_cached}


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


def needed_read(
    index: CheckpointIndex, names: Iterable[str], chunk_bytes: int = CHUNK_BYTES
) -> int:
    """The reload's own reads of ``names`` without its transform: coalesced runs in file
    order, a chunk of the reload's size at a time, into a reused buffer. Returns bytes read."""
    infos = sorted((index.info(name) for name in names), key=lambda i: (i.file, i.begin))
    with RangeReader(depth=1) as reader:
        for _ in reader.chunks(chunked(infos, chunk_bytes)):
            pass
    return reader.bytes_read


def stream_read(files: Iterable[Path], chunk_bytes: int = 16 << 20) -> int:
    """Every byte of ``files``, front to back in ``chunk_bytes`` reads with the kernel's
    readahead on: the fastest way this storage delivers whole shards. Returns bytes read."""
    buffer = bytearray(chunk_bytes)
    total = 0
    for file in sorted(files):
        with file.open("rb", buffering=0) as handle:
            while got := handle.readinto(buffer):
                total += got
    return total


def naive_reload(
    index: CheckpointIndex,
    slots: ExpertSlots,
    assignments: Iterable[Assignment],
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """The naive baseline: load every expert to host memory, then pick the needed ones."""
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


def needed_names(index: CheckpointIndex, assignments: Iterable[Assignment]) -> list[str]:
    """Checkpoint tensor names of every (layer, expert) the assignments load."""
    wanted = {(layer, expert) for layer, _, expert in assignments}
    return sorted(name for key, name in index.experts.items() if key[:2] in wanted)


def slot_digest(slots: ExpertSlots) -> str:
    """sha256 over every slot tensor, to check two loaders wrote the same bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(slots.tensors().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _throttled(conn: Connection, phase: str) -> Callable[[int, int], None]:
    last = [0.0]

    def send(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.1 or done >= total:
            last[0] = now
            conn.send(("progress", phase, done, total))

    return send


def timed_runs(run: Callable[[], object], prep: Callable[[], None], repeat: int) -> list[float]:
    """Wall seconds of ``repeat`` runs of ``run``, each after ``prep`` (untimed)."""
    times = []
    for _ in range(repeat):
        prep()
        gc.collect()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


@attrs.frozen
class FirstRun:
    """The first timed run of a loader: peak RSS delta (bytes, and how it was measured),
    wall seconds, and bytes fetched from storage (None where the OS does not say)."""

    peak_rss: int
    rss_method: str
    seconds: float
    disk_read: int | None


def _first_run(run: Callable[[], object], prep: Callable[[], None]) -> FirstRun:
    prep()
    gc.collect()
    disk_before = disk_read_bytes()
    with PeakRss() as meter:
        started = time.perf_counter()
        run()
        seconds = time.perf_counter() - started
    disk_after = disk_read_bytes()
    disk = None if disk_before is None or disk_after is None else disk_after - disk_before
    return FirstRun(meter.delta, meter.method, seconds, disk)


def _time_by_cache(
    job: ChildJob,
    index: CheckpointIndex,
    runs: tuple[Callable[[], object], Callable[[], object]],
    prefix: str,
    extra: Callable[[CachePrep], dict[str, Any]] | None = None,
) -> tuple[FirstRun, dict[str, dict[str, Any]]]:
    """Time a loader ``job.repeat`` times under each page-cache state of ``job``.

    ``runs`` is (the loader, its first run: the same with progress reports). The very
    first run measures peak RSS and disk reads; the best time of each state counts, as
    ``{prefix}reload_s`` beside ``{prefix}disk_read_bytes`` (first state only) and what
    ``extra(prep)`` adds after the timed runs. Returns (first run, rows by cache state).
    """
    run, run_first = runs
    by_cache: dict[str, dict[str, Any]] = {}
    peak: FirstRun | None = None
    for cache in job.caches:
        prep = CachePrep(list(index.files), cache)
        row: dict[str, Any] = {}
        times = []
        if peak is None:
            peak = _first_run(run_first, prep)
            times.append(peak.seconds)
            row[f"{prefix}disk_read_bytes"] = peak.disk_read
        times += timed_runs(run, prep, job.repeat - len(times))
        row[f"{prefix}reload_s"] = min(times)
        by_cache[cache] = {**row, **(extra(prep) if extra is not None else {})}
    if peak is None:
        raise BenchError("no page-cache state to measure: ChildJob.caches is empty")
    return peak, by_cache


def _measure_selective(
    job: ChildJob, index: CheckpointIndex, slots: ExpertSlots, conn: Connection
) -> dict[str, Any]:
    before = slots.data_ptrs()
    names = needed_names(index, job.reload)
    first: list[ReloadStats] = []

    def reload(workers: int = job.workers) -> None:
        load_experts_into_slots(index, slots, job.reload, workers=workers)

    def reload_first() -> None:
        progress = _throttled(conn, "reload")
        stats = load_experts_into_slots(
            index, slots, job.reload, workers=job.workers, progress=progress
        )
        first.append(stats)

    def baselines(prep: CachePrep) -> dict[str, Any]:
        def best(run: Callable[[], object]) -> float:
            return min(timed_runs(run, prep, job.repeat))

        row = {
            "raw_read_s": best(lambda: raw_read(index, names)),
            "storage_needed_read_s": best(lambda: needed_read(index, names)),
            "storage_all_read_s": best(lambda: stream_read(index.files)),
        }
        if job.workers > 1:
            row["reload_serial_s"] = best(lambda: reload(1))
        return {**row, **(prep.report() if prep.cache == "cold" else {})}

    peak, by_cache = _time_by_cache(job, index, (reload, reload_first), "", baselines)
    stats = first[0]
    common = {
        "experts_reloaded": stats.experts,
        "bytes_needed": stats.bytes_needed,
        "bytes_read": stats.bytes_read,
        "peak_rss_delta_bytes": peak.peak_rss,
        "rss_method": peak.rss_method,
        "in_place": before == slots.data_ptrs(),
    }
    return {"common": common, "by_cache": by_cache}


def _measure_naive(
    job: ChildJob, index: CheckpointIndex, slots: ExpertSlots, conn: Connection
) -> dict[str, Any]:
    def naive() -> None:
        naive_reload(index, slots, job.reload)

    def naive_first() -> None:
        naive_reload(index, slots, job.reload, _throttled(conn, "naive load"))

    peak, by_cache = _time_by_cache(job, index, (naive, naive_first), "naive_")
    return {"common": {"naive_peak_rss_delta_bytes": peak.peak_rss}, "by_cache": by_cache}


def _child(job: ChildJob, conn: Connection) -> None:
    """Child-process entry: fill the worker's slots, then measure ``job``; report on ``conn``."""
    try:
        # One intra-op thread by default: on a shared host an OpenMP team waiting for a busy
        # core distorts small copies by orders of magnitude; all three loaders get the same.
        torch.set_num_threads(job.threads)
        index = CheckpointIndex.open(job.path)
        slots = ExpertSlots.allocate(index, job.layers, job.local_slots)
        progress = _throttled(conn, "initial load")
        load_experts_into_slots(index, slots, job.initial, progress=progress)
        gc.collect()
        measure = _measure_selective if job.mode == "selective" else _measure_naive
        result = measure(job, index, slots, conn)
        result["slot_digest"] = slot_digest(slots)
        conn.send(("result", result))
    except BaseException as exc:  # the parent re-raises it with the child's story
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        conn.close()


def run_child(job: ChildJob, timeout_s: float, progress: ProgressFn | None) -> dict[str, Any]:
    """Run ``job`` in a fresh spawned process; kill it (by pid) past ``timeout_s``.

    Returns ``{"common": {...}, "by_cache": {cache: {...}}, "slot_digest": str}``.
    """
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(job, sender))
    child.start()
    sender.close()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not receiver.poll(0.1):
                continue
            try:
                message = receiver.recv()
            except EOFError as exc:  # poll() also reports the pipe closed by a dead child
                child.join(5.0)
                raise BenchError(
                    f"{job.mode} child exited with code {child.exitcode} before reporting; "
                    "its stderr says why (a negative code is the signal that killed it)"
                ) from exc
            if message[0] == "progress":
                if progress is not None:
                    progress(message[1], message[2], message[3])
            elif message[0] == "error":
                cause = ChildTraceback(message[2])
                raise BenchError(f"{job.mode} child failed: {message[1]}") from cause
            else:
                return dict(message[1])
        raise BenchError(f"{job.mode} child ran past {timeout_s:.0f} s; raise --timeout")
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()
