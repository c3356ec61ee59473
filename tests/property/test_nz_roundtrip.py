"""Property: FRACTAL_NZ round-trips every shape and dtype, padding is zero, shapes follow §6."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from ftengine.weights.nz import M0, from_fractal_nz, n0_for, nz_shape, to_fractal_nz

DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.int8])


@st.composite
def nd_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(DTYPES)
    batch = draw(st.lists(st.integers(1, 3), max_size=2))
    m, n = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 128, (*batch, m, n), generator=gen, dtype=torch.int8)
    return torch.randn((*batch, m, n), generator=gen).to(dtype)


@given(nd_tensors())
def test_round_trip(x: torch.Tensor) -> None:
    m, n = x.shape[-2:]
    assert torch.equal(from_fractal_nz(to_fractal_nz(x), m, n), x)


@given(nd_tensors())
def test_shape_and_padding(x: torch.Tensor) -> None:
    m, n = x.shape[-2:]
    n0 = n0_for(x.dtype)
    nz = to_fractal_nz(x)
    assert nz.shape == (*x.shape[:-2], -(-n // n0), -(-m // M0) * M0, n0)
    assert tuple(nz.shape) == nz_shape(x.shape, x.dtype)
    # Count of non-padding positions equals m * n; padding positions are zero.
    mask = torch.zeros(nz.shape[-3:], dtype=torch.bool)
    cols = torch.arange(mask.shape[0] * n0).reshape(mask.shape[0], 1, n0)
    rows = torch.arange(mask.shape[1]).reshape(1, -1, 1)
    mask = (cols < n) & (rows < m)
    assert int(mask.sum()) == m * n
    assert torch.count_nonzero(nz[..., ~mask]) == 0


@given(nd_tensors())
def test_out_matches_fresh(x: torch.Tensor) -> None:
    out = torch.ones(nz_shape(x.shape, x.dtype), dtype=x.dtype)
    assert torch.equal(to_fractal_nz(x, out=out), to_fractal_nz(x))
