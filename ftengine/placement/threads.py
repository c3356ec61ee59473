"""Run the placement code's small tensor ops on one intra-op thread."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Use one torch intra-op thread inside the block, then restore the previous setting.

    The planner's tensors are small: extra threads only add synchronisation, which on a
    loaded 2-core host made a plan 10-30x slower. Results never depend on the thread count
    (the planner uses no order-dependent float reductions). The setting is process-wide;
    recovery runs while the worker is quarantined, so no model compute shares the window.
    """
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
