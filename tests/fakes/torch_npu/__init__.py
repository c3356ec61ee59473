"""A recording fake of ``torch_npu`` on CPU tensors, for tests only (never installed).

Put ``tests/fakes`` on ``sys.path`` (``tests.fakes.npu_install.fake_torch_npu``) and
``import torch_npu`` finds this package. Every call lands in ``tests.fakes.npu_state.STATE``.
The functions take exactly the published signatures (of the torch_npu release
``STATE.version`` names, and the op-plugin schemas), so a misspelt keyword raises
``TypeError`` here as it does on a real NPU.
``npu_format_cast`` keeps the logical size, as torch_npu does, and remembers the format.
"""

from __future__ import annotations

import torch

from ftengine.weights.nz import ACL_FORMAT_FRACTAL_NZ, nz_shape
from tests.fakes.npu_state import ACL_FORMAT_ND, STATE

# Relative imports: this package is imported as top-level ``torch_npu`` by the tests.
from . import distributed, npu
from ._mc2 import npu_moe_distribute_combine_v2, npu_moe_distribute_dispatch_v2

__version__ = f"{STATE.version}+fake"

__all__ = [
    "__version__",
    "distributed",
    "get_npu_format",
    "npu",
    "npu_format_cast",
    "npu_moe_distribute_combine_v2",
    "npu_moe_distribute_dispatch_v2",
]


def npu_format_cast(input: torch.Tensor, acl_format: int, /) -> torch.Tensor:
    """A copy of ``input`` in storage format ``acl_format`` (ND 2 or FRACTAL_NZ 29).

    The logical ``.size()`` is kept; the NZ block shape is checked to exist for the dtype
    (``nz_shape``), which is all the fake can say about the physical layout.
    """
    STATE.record("npu_format_cast", input, acl_format)
    STATE.require_usable("npu_format_cast")
    if acl_format not in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ):
        raise ValueError(
            f"the fake npu_format_cast supports ND (2) and FRACTAL_NZ (29), got {acl_format}"
        )
    if acl_format == ACL_FORMAT_FRACTAL_NZ:
        nz_shape(input.shape, input.dtype)  # raises for a tensor NZ cannot hold
    out = input.clone()
    STATE.remember_format(out, acl_format)
    return out


def get_npu_format(input: torch.Tensor, /) -> int:
    """The storage format ``npu_format_cast`` gave ``input``'s storage (ND when never cast)."""
    return STATE.format_of(input)
