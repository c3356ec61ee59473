"""Every process group ftengine's CPU backend made is re-created by a rebuild (the second
seed's review point): the backend holds one gloo group per epoch
(``ftengine/testbed/cpu/backend.py``; nothing in ``ftengine/testbed/cluster`` makes a group of
its own) and the MoE layers reach it through ``comm()`` each call, so after a rebuild nothing
may still use the old one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftengine.errors import BackendError
from ftengine.faults import Fault, FaultKind
from tests.gloo_support import one_rank_backend, one_rank_store, tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("cpu-groups") / "ckpt")


@pytest.mark.timeout(60)
def test_a_rebuild_replaces_the_group_and_the_old_one_is_unusable(checkpoint: Path) -> None:
    backend = one_rank_backend(checkpoint, one_rank_store())
    try:
        old = backend.comm()
        backend.quarantine(Fault(FaultKind.TRANSIENT, rank=0))
        backend.rebuild_groups(frozenset({0}), old.epoch + 1)
        new = backend.comm()
        assert new is not old and (new.epoch, new.members) == (old.epoch + 1, (0,))
        with pytest.raises(BackendError):
            old.all_to_all(torch.zeros(1, dtype=torch.int64), [1], [1])
        # The MoE layers and the DP sync run on the new group (the old one would raise).
        backend.run_dummy_batch()
        assert backend.dp_sync(3, 1).tolist() == [3]
    finally:
        backend.close()
