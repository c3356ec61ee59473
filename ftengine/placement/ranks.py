"""Dead-rank bookkeeping: DP ranks to EP ranks, the cumulative dead set, DP-sync neutralisation.

Ranks here are always the ORIGINAL ranks; the dead set only grows across scale-downs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch

from ftengine.errors import PreconditionFailed


def dp_to_ep_ranks(dp_ranks: Iterable[int], tp_size: int) -> frozenset[int]:
    """EP ranks of the given DP ranks: DP rank ``d`` owns ``d * tp_size + t`` for ``t < tp``."""
    if tp_size < 1:
        raise PreconditionFailed(f"tp_size must be >= 1, got {tp_size}")
    return frozenset(d * tp_size + t for d in dp_ranks for t in range(tp_size))


@attrs.frozen
class DeadRankSet:
    """The cumulative set of dead DP ranks of a DP x TP deployment (EP world = DP x TP)."""

    dp_world: int
    tp_size: int = 1
    dp: frozenset[int] = frozenset()

    @property
    def ep_world(self) -> int:
        """Original EP world size."""
        return self.dp_world * self.tp_size

    @property
    def ep(self) -> frozenset[int]:
        """Dead EP ranks."""
        return dp_to_ep_ranks(self.dp, self.tp_size)

    @property
    def alive_dp(self) -> frozenset[int]:
        """Surviving original DP ranks."""
        return frozenset(range(self.dp_world)) - self.dp

    def scale_down(
        self, removed_dp_ranks: Iterable[int], *, receiving_rank: int | None = None
    ) -> DeadRankSet:
        """The dead set after a ``scale_down`` naming ``removed_dp_ranks`` (cumulative).

        Follows vLLM's preconditions: non-empty, original ranks in range, not the rank
        receiving the command, not every rank, and at least one newly dead rank. Raises
        ``PreconditionFailed`` listing every failed condition.
        """
        removed = list(removed_dp_ranks)
        removed_set = frozenset(removed)
        reasons: list[str] = []
        if not removed:
            reasons.append("removed_dp_ranks is empty; name at least one dead DP rank")
        out_of_range = sorted(r for r in removed_set if not 0 <= r < self.dp_world)
        if out_of_range:
            reasons.append(
                f"removed_dp_ranks {out_of_range} are not original DP ranks "
                f"(expected values in [0, {self.dp_world}))"
            )
        if receiving_rank is not None and receiving_rank in removed_set:
            reasons.append(f"removed_dp_ranks contains the receiving rank {receiving_rank}")
        dead = self.dp | removed_set
        if not self.alive_dp - dead:
            reasons.append(f"removing {sorted(dead)} would leave no DP rank of {self.dp_world}")
        if removed and removed_set <= self.dp:
            reasons.append(
                f"removed_dp_ranks {sorted(removed_set)} are all already removed "
                f"(dead so far: {sorted(self.dp)}); name a newly dead rank"
            )
        if reasons:
            raise PreconditionFailed("scale_down refused: " + "; ".join(reasons), tuple(reasons))
        return attrs.evolve(self, dp=dead)


def check_ep_ranks(dead_ep_ranks: Iterable[int], ep_size: int) -> frozenset[int]:
    """Validate a dead EP set against ``ep_size``; raise ``PreconditionFailed`` if invalid."""
    dead = frozenset(dead_ep_ranks)
    bad = sorted(r for r in dead if not 0 <= r < ep_size)
    reasons = []
    if bad:
        reasons.append(f"dead EP ranks {bad} are out of range [0, {ep_size})")
    if len(dead) >= ep_size and not bad:
        reasons.append(f"all {ep_size} EP ranks are dead; at least one must survive")
    if reasons:
        raise PreconditionFailed("; ".join(reasons), tuple(reasons))
    return dead


def neutralize_dead_columns(
    tensor: torch.Tensor,
    dead_dp_ranks: Iterable[int],
    neutral: float | int | bool | Sequence[float | int | bool] | torch.Tensor,
) -> None:
    """Overwrite dead ranks' columns of a per-step DP sync tensor, in place.

    ``tensor`` is ``[..., dp_world]`` (the DP rank is the last dimension, as in vLLM's
    per-step DP metadata sync). ``neutral`` is one value for every row, or one value per
    row of a 2-D ``[rows, dp_world]`` tensor — e.g. 0 for token counts that are summed or
    maxed, 1 for flags that are AND-ed — so that the dead ranks never change the result
    the survivors agree on.
    """
    dp_world = int(tensor.shape[-1])
    dead = sorted(frozenset(dead_dp_ranks))
    bad = [r for r in dead if not 0 <= r < dp_world]
    if bad:
        raise PreconditionFailed(
            f"dead DP ranks {bad} are out of range for a sync tensor with {dp_world} columns"
        )
    if not dead:
        return
    columns = torch.tensor(dead, dtype=torch.int64, device=tensor.device)
    if isinstance(neutral, (int, float, bool)):
        tensor.index_fill_(-1, columns, neutral)
        return
    values = torch.as_tensor(neutral, dtype=tensor.dtype, device=tensor.device)
    if tensor.dim() != 2 or values.shape != (tensor.shape[0],):
        raise PreconditionFailed(
            "per-row neutral values need a 2-D [rows, dp_world] tensor and one value per row; "
            f"got tensor {tuple(tensor.shape)} and {tuple(values.shape)} values"
        )
    tensor[:, columns] = values.unsqueeze(1).expand(-1, len(dead))
