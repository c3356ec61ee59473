"""Hypothesis strategies for expert placements, dead-rank sets and load tables."""

from __future__ import annotations

import attrs
import torch
from hypothesis import strategies as st

from ftengine.placement.maps import ExpertPlacement


@attrs.frozen
class Shape:
    """A small placement shape: every rank owns ``local_slots`` slots."""

    layers: int
    experts: int
    ep: int
    local_slots: int

    @property
    def physical(self) -> int:
        return self.ep * self.local_slots

    @property
    def redundant(self) -> int:
        return self.physical - self.experts


@st.composite
def shapes(draw: st.DrawFn, *, max_ep: int = 6, max_local: int = 4) -> Shape:
    """Shapes with 1-3 layers, 2-6 EP ranks and at least one slot per expert."""
    ep = draw(st.integers(2, max_ep))
    local = draw(st.integers(1, max_local))
    experts = draw(st.integers(1, ep * local))
    return Shape(draw(st.integers(1, 3)), experts, ep, local)


@st.composite
def slot_maps(draw: st.DrawFn, shape: Shape, *, holes: bool = False) -> torch.Tensor:
    """int64 ``[layers, physical]``: every expert once, the spare slots random, shuffled.

    With ``holes`` a spare slot may also be empty (-1).
    """
    rows = []
    for _ in range(shape.layers):
        extras = draw(
            st.lists(
                st.integers(-1 if holes else 0, shape.experts - 1),
                min_size=shape.redundant,
                max_size=shape.redundant,
            )
        )
        row = list(range(shape.experts)) + extras
        rows.append(draw(st.permutations(row)))
    return torch.tensor(rows, dtype=torch.int64)


@st.composite
def placements(
    draw: st.DrawFn, shape: Shape | None = None, *, holes: bool = False
) -> ExpertPlacement:
    """A valid random placement (every expert has at least one replica)."""
    chosen = shape if shape is not None else draw(shapes())
    return ExpertPlacement.from_physical_to_logical(
        draw(slot_maps(chosen, holes=holes)), num_logical=chosen.experts, ep_size=chosen.ep
    )


def dead_sets(ep: int, *, min_size: int = 1) -> st.SearchStrategy[frozenset[int]]:
    """Dead EP rank sets that leave at least one rank alive."""
    return st.frozensets(st.integers(0, ep - 1), min_size=min_size, max_size=ep - 1)


@st.composite
def loads(draw: st.DrawFn, layers: int, experts: int) -> torch.Tensor | None:
    """``None`` (uniform) or a non-negative float64 ``[layers, experts]`` load table."""
    if draw(st.booleans()):
        return None
    values = draw(
        st.lists(
            st.integers(0, 1000),
            min_size=layers * experts,
            max_size=layers * experts,
        )
    )
    return torch.tensor(values, dtype=torch.float64).view(layers, experts)
