"""A released gloo group is unusable at once and torn down off the caller's thread."""

from __future__ import annotations

import pytest
import torch

from ftengine.errors import BackendError
from ftengine.testbed.cpu.comm import GlooGroup
from tests.gloo_support import one_rank_store


def test_released_group_refuses_collectives() -> None:
    store = one_rank_store()
    group = GlooGroup(store, frozenset({0}), 0, 3, op_timeout_s=5.0, rendezvous_timeout_s=5.0)
    tensor = torch.ones(2)
    group.all_reduce_sum(tensor)
    assert tensor.tolist() == [1.0, 1.0]
    group.release()
    with pytest.raises(BackendError, match="epoch-3 gloo group was released"):
        group.all_reduce_sum(tensor)
    with pytest.raises(BackendError, match="rebuild the groups"):
        group.all_to_all(tensor, [2], [2])
