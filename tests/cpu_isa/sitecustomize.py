"""Test support: a Python started with this folder on ``PYTHONPATH`` and
``FTENGINE_TEST_CPU_ISA`` set sees a smaller x86-64 CPU through torch's feature probes.

vLLM picks its kernel library (``_C_AVX2``, ``_C_AVX512`` or ``_C``) and several code paths
(AMX, AVX512-BF16) from ``torch.cpu._is_*_supported()``. Capping those answers on a bigger
CPU makes vLLM load and run the smaller CPU's kernels for real (AVX2 code runs on an AVX-512
CPU), which is how the suite covers a CPU it does not run on. ``ATEN_CPU_CAPABILITY`` (set by
:func:`tests.cpu_isa_support.simulated_cpu_env`) does the same for torch's own kernels.
A feature the real CPU lacks is never claimed: the probes can only be turned off.
"""

from __future__ import annotations

import os

# The probes each simulated CPU answers False (the rest keep the real CPU's answer).
OFF = {
    "avx2": (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ),
    "avx512": ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"),
}


def _install(isa: str) -> None:
    import torch

    if isa not in OFF:
        raise ValueError(f"FTENGINE_TEST_CPU_ISA={isa!r}: expected one of {sorted(OFF)}")
    for name in OFF[isa]:
        if not hasattr(torch.cpu, name):
            raise AttributeError(
                f"torch.cpu.{name} is gone: update tests/cpu_isa ({torch.__version__})"
            )
        setattr(torch.cpu, name, _false)


def _false() -> bool:
    return False


if os.environ.get("FTENGINE_TEST_CPU_ISA"):
    _install(os.environ["FTENGINE_TEST_CPU_ISA"])
