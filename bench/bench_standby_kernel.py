"""What standby expert copies cost vLLM's CPU MoE kernel; prints one JSON object.

Usage: ``.venv/bin/python bench/bench_standby_kernel.py [ROUNDS [THREADS]]``. vLLM's
``cpu_fused_moe`` (what ``CPUUnquantizedExperts.apply`` calls) on one layer of the tests'
tiny Qwen3-MoE (hidden 128, expert intermediate 64, top-2; weights prepacked as vLLM does) holding 4
experts, against the same layer with 4 standby rows appended (DP=2 failure-aware
placement), the same routed local ids in both (ids route only to active rows, as the
patched ``apply`` gives them). ``ROUNDS`` (default 15) alternate the two; each round times
200 calls. Per token count: the fastest round's microseconds per call of each (on a
shared machine the least disturbed one), their ratio, the medians, and whether the outputs
are bitwise equal. ``THREADS`` (default 1) is torch's intra-op thread count: on a shared
machine a multi-threaded kernel mostly measures its wait for a busy sibling core.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from vllm import _custom_ops as ops

HIDDEN, INTER, TOPK, ACTIVE = 128, 64, 2, 4
CALLS = 200
Weights = tuple[torch.Tensor, torch.Tensor]


def packed(w13: torch.Tensor, w2: torch.Tensor) -> Weights:
    return ops.cpu_prepack_moe_weight(w13, "vec"), ops.cpu_prepack_moe_weight(w2, "vec")


def per_call_us(weights: Weights, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> float:
    out = torch.empty_like(x)
    started = time.perf_counter()
    for _ in range(CALLS):
        ops.cpu_fused_moe(out, x, *weights, None, None, w, ids, "silu", "vec", False)
    return (time.perf_counter() - started) / CALLS * 1e6


def output(weights: Weights, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    ops.cpu_fused_moe(out, x, *weights, None, None, w, ids, "silu", "vec", False)
    return out


def measure(tokens: int, rounds: int, active: Weights, with_standby: Weights) -> dict[str, object]:
    x = torch.randn(tokens, HIDDEN)
    ids = torch.randint(0, ACTIVE, (tokens, TOPK), dtype=torch.int32)
    w = torch.rand(tokens, TOPK)
    times: dict[str, list[float]] = {"active_only_us": [], "with_standby_us": []}
    for _ in range(rounds):
        for name, weights in (("active_only_us", active), ("with_standby_us", with_standby)):
            times[name].append(per_call_us(weights, x, ids, w))
    best = {name: min(values) for name, values in times.items()}
    medians = {f"{name[:-3]}_median_us": statistics.median(v) for name, v in times.items()}
    same = torch.equal(output(active, x, ids, w), output(with_standby, x, ids, w))
    ratio = best["with_standby_us"] / best["active_only_us"]
    return {"tokens": tokens, **best, "ratio": ratio, **medians, "outputs_equal": same}


def main(rounds: int) -> dict[str, object]:
    torch.manual_seed(0)
    w13 = torch.randn(2 * ACTIVE, 2 * INTER, HIDDEN) * 0.1
    w2 = torch.randn(2 * ACTIVE, HIDDEN, INTER) * 0.1
    active, with_standby = packed(w13[:ACTIVE], w2[:ACTIVE]), packed(w13, w2)
    for _ in range(3):  # warm the kernel's scratch buffers and thread pool
        measure(64, 1, active, with_standby)
    rows = [measure(n, rounds, active, with_standby) for n in (1, 8, 64, 256)]
    return {"threads": torch.get_num_threads(), "rounds": rounds, "calls": CALLS, "rows": rows}


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)))
