#!/usr/bin/env bash
# Creates or updates .venv/ in the repository root with the CPU profile (torch 2.13.0 CPU, triton 3.7.1,
# sglang 0.5.23 and flashinfer 0.7.2 without their dependencies, transformers, the small models and data).
# Idempotent: a hash of the inputs is stored in .venv/.setup-stamp and an unchanged set-up is skipped.
# A GPU host does not use this script: it installs `pip install "sglang-spec[sglang]"`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
inputs=(requirements-cpu.txt requirements-nodeps.txt pyproject.toml scripts/setup.sh)
want=$(cat "${inputs[@]}" | sha256sum | cut -d' ' -f1)
if [[ -x .venv/bin/python && "$(cat .venv/.setup-stamp 2>/dev/null)" == "$want" ]]; then
    exit 0
fi

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "error: Python >= 3.11 is needed (sglang 0.5.23 requires it); set PYTHON=/path/to/python3.11" >&2
    exit 2
fi

quiet_pip() {
    # This machine's pip configuration names local indexes that may be absent; their warnings are noise.
    .venv/bin/pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

echo "setting up .venv (first run downloads ~3 GB and takes a few minutes) ..." >&2
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
quiet_pip install --disable-pip-version-check -q -r requirements-cpu.txt
quiet_pip install --disable-pip-version-check -q --no-deps -r requirements-nodeps.txt
quiet_pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
# the AVX-512 small-GEMM kernel, compiled now rather than in the first run (a CPU without AVX-512 or a missing
# compiler is reported in one line; the decoder then uses MKL's GEMMs)
.venv/bin/python -c "from sglang_spec.gemm.small_gemm import load_small_gemm as l, SmallGemmUnavailable as U
try: l()
except U as e: print('note: the AVX-512 small-GEMM kernel is not available here:', e)"
echo "$want" > .venv/.setup-stamp
echo ".venv is ready" >&2
