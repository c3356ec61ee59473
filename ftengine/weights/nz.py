"""FRACTAL_NZ reference transform in pure torch (REFERENCE §6).

The CPU path and the tests use it; the NPU backend calls ``torch_npu.npu_format_cast(x, 29)``
instead. ND ``[..., m, n]`` becomes ``[..., ceil(n/n0), ceil(m/16)*16, n0]`` with
``n0 = 32 bytes / min(element size, 2)`` and zero padding; ``ND[i, j] -> NZ[j // n0, i, j % n0]``.
The element order is inferred from the shape convention (unconfirmed upstream), so every
index computation lives in the two functions below.
"""

from __future__ import annotations

import torch

from ftengine.errors import WeightLoadError

ACL_FORMAT_FRACTAL_NZ = 29
"""The ``acl_format`` id torch_npu uses for FRACTAL_NZ."""

M0 = 16
"""Rows per fractal block."""

_BLOCK_BYTES = 32
_N0_ITEMSIZE_CAP = 2
"""torch_npu caps the element size at 2 bytes when it picks n0, so fp32 blocks are 16 wide."""


def n0_for(dtype: torch.dtype) -> int:
    """Columns per fractal block for ``dtype``: 32 for int8, 16 for fp16/bf16 and fp32."""
    size = torch.empty((), dtype=dtype).element_size()
    if size > _BLOCK_BYTES:
        raise WeightLoadError(
            f"FRACTAL_NZ needs elements of at most {_BLOCK_BYTES} bytes, found {dtype} "
            f"({size} bytes); keep such tensors in ND format"
        )
    return _BLOCK_BYTES // min(size, _N0_ITEMSIZE_CAP)


def nz_shape(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> tuple[int, ...]:
    """The FRACTAL_NZ shape of an ND tensor of ``shape`` [..., m, n] and ``dtype``.

    Example: fp16 ``(8, 100, 30)`` -> ``(8, 2, 112, 16)``.
    """
    if len(shape) < 2:
        raise WeightLoadError(f"FRACTAL_NZ needs at least 2 dimensions, found shape {tuple(shape)}")
    *batch, m, n = shape
    n0 = n0_for(dtype)
    return (*batch, -(-n // n0), -(-m // M0) * M0, n0)


def to_fractal_nz(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Convert ND ``x`` [..., m, n] to FRACTAL_NZ [..., ceil(n/n0), ceil(m/16)*16, n0].

    With ``out`` (shape ``nz_shape(x.shape, x.dtype)``, same dtype) the result is written
    there in place, padding included, and ``out`` is returned.
    """
    expected = nz_shape(x.shape, x.dtype)
    if out is None:
        out = x.new_empty(expected)
    elif tuple(out.shape) != expected or out.dtype != x.dtype:
        raise WeightLoadError(
            f"FRACTAL_NZ destination must be {expected} {x.dtype}, found "
            f"{tuple(out.shape)} {out.dtype}; allocate it with nz_shape()"
        )
    m, n = x.shape[-2], x.shape[-1]
    n0 = expected[-1]
    full, rest = divmod(n, n0)
    if full:
        # [..., m, full*n0] -> [..., m, full, n0] -> [..., full, m, n0]
        head = x[..., : full * n0]
        blocks = head.reshape(*head.shape[:-1], full, n0).transpose(-3, -2)
        out[..., :full, :m, :].copy_(blocks)
    if rest:
        out[..., full, :m, :rest].copy_(x[..., full * n0 :])
        out[..., full, :m, rest:].zero_()
    out[..., :, m:, :].zero_()
    return out


def from_fractal_nz(x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Convert FRACTAL_NZ ``x`` [..., n1, m1, n0] back to a contiguous ND [..., m, n].

    ``m`` and ``n`` are the logical ND sizes (torch_npu keeps them as ``.size()``).
    """
    if x.dim() < 3:
        raise WeightLoadError(f"FRACTAL_NZ needs at least 3 dimensions, found {tuple(x.shape)}")
    expected = nz_shape((*x.shape[:-3], m, n), x.dtype)
    if tuple(x.shape) != expected:
        raise WeightLoadError(
            f"a FRACTAL_NZ tensor of logical size [{m}, {n}] must be {expected}, found "
            f"{tuple(x.shape)}; pass the logical ND sizes it was made from"
        )
    n1, n0 = x.shape[-3], x.shape[-1]
    # [..., n1, m, n0] -> [..., m, n1, n0] -> [..., m, n1*n0]
    nd = x[..., :m, :].transpose(-3, -2).reshape(*x.shape[:-3], m, n1 * n0)
    return nd[..., :n].contiguous()
