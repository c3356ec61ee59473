"""FRACTAL_NZ reference transform: REFERENCE §6 shape example and element placement."""

from __future__ import annotations

import pytest
import torch

from ftengine.errors import WeightLoadError
from ftengine.weights.nz import (
    ACL_FORMAT_FRACTAL_NZ,
    from_fractal_nz,
    n0_for,
    nz_shape,
    to_fractal_nz,
)


def test_reference_shape_example_fp16() -> None:
    x = torch.randn(8, 100, 30).to(torch.float16)
    nz = to_fractal_nz(x)
    assert nz.shape == (8, 2, 112, 16)
    assert nz_shape((8, 100, 30), torch.float16) == (8, 2, 112, 16)


def test_acl_format_id() -> None:
    assert ACL_FORMAT_FRACTAL_NZ == 29


@pytest.mark.parametrize(
    ("dtype", "n0"),
    [(torch.float16, 16), (torch.bfloat16, 16), (torch.int8, 32), (torch.float32, 16)],
)
def test_n0_is_32_bytes_per_block_with_fp32_capped_at_16(dtype: torch.dtype, n0: int) -> None:
    assert n0_for(dtype) == n0


def test_element_placement_and_zero_padding() -> None:
    m, n = 20, 40
    x = (torch.arange(m * n, dtype=torch.int32).reshape(m, n) % 100 + 1).to(torch.int8)
    nz = to_fractal_nz(x)
    assert nz.shape == (2, 32, 32)
    for i in range(m):
        for j in range(n):
            assert nz[j // 32, i, j % 32] == x[i, j]
    assert torch.count_nonzero(nz[:, m:, :]) == 0  # padded rows
    assert torch.count_nonzero(nz[1, :, n - 32 :]) == 0  # padded columns of the last block


def test_out_is_written_in_place_including_padding() -> None:
    x = torch.randn(5, 17).to(torch.bfloat16)
    out = torch.full(nz_shape(x.shape, x.dtype), 7.0, dtype=torch.bfloat16)
    ptr = out.data_ptr()
    result = to_fractal_nz(x, out=out)
    assert result.data_ptr() == ptr
    assert torch.equal(result, to_fractal_nz(x))


def test_round_trip_exact() -> None:
    x = torch.randint(-128, 127, (3, 33, 65), dtype=torch.int8)
    assert torch.equal(from_fractal_nz(to_fractal_nz(x), 33, 65), x)


def test_wrong_out_shape_and_logical_size_are_errors() -> None:
    x = torch.zeros(4, 4, dtype=torch.float16)
    with pytest.raises(WeightLoadError, match="destination must be"):
        to_fractal_nz(x, out=torch.zeros(1, 16, 8, dtype=torch.float16))
    with pytest.raises(WeightLoadError, match="logical size"):
        from_fractal_nz(to_fractal_nz(x), 40, 4)
    with pytest.raises(WeightLoadError, match="at least 2 dimensions"):
        to_fractal_nz(torch.zeros(4))
