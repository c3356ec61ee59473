"""A recording fake of ``torch_npu`` on CPU tensors, for tests only (never installed).

Put ``tests/fakes`` on ``sys.path`` (``tests.fakes.npu_install.install_fake_torch_npu``)
and ``import torch_npu`` finds this package. Every call lands in
``tests.fakes.npu_state.STATE``; ``npu_format_cast`` uses ftengine's reference NZ
transform, so its output has the NZ *physical* shape (the real op keeps the logical one).
"""

from __future__ import annotations

import torch

from ftengine.weights.nz import ACL_FORMAT_FRACTAL_NZ, to_fractal_nz
from tests.fakes.npu_state import STATE

# Relative imports: this package is imported as top-level ``torch_npu`` by the tests.
from . import distributed, npu
from ._mc2 import npu_moe_distribute_combine_v2, npu_moe_distribute_dispatch_v2

__version__ = "0.0.0+fake"
ACL_FORMAT_ND = 2

__all__ = [
    "__version__",
    "distributed",
    "npu",
    "npu_format_cast",
    "npu_moe_distribute_combine_v2",
    "npu_moe_distribute_dispatch_v2",
]


def npu_format_cast(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """FRACTAL_NZ (29) through the reference transform; ND (2) is the identity."""
    STATE.record("npu_format_cast", tensor, acl_format)
    STATE.require_usable("npu_format_cast")
    if acl_format == ACL_FORMAT_FRACTAL_NZ:
        return to_fractal_nz(tensor)
    if acl_format == ACL_FORMAT_ND:
        return tensor
    raise ValueError(
        f"the fake npu_format_cast supports ND (2) and FRACTAL_NZ (29), got {acl_format}"
    )
