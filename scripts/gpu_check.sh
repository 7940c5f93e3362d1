#!/usr/bin/env bash
# Every GPU-only check in one command, for a bare CUDA machine with this repository, PyTorch, Triton and numpy:
#   scripts/gpu_check.sh              # on a GPU: under 9 minutes; results in docs/results/gpu-check.json and one
#                                     # row per check recorded in docs/gpu-validation.md
#   scripts/gpu_check.sh --dry-run    # anywhere: lists the checks and runs them on the CPU at tiny sizes
# The server groups (--group server, server-mla, ...) on a machine without sglang need the payload beside the
# checkout: `python bench/gpu_server_payload.py` here writes .gpu-payload/ (git-ignored), which the device call
# carries (carry: [".gpu-payload"]); each group's first check unpacks it.
# PYTHON picks the interpreter (default: .venv/bin/python where set up, else python3). The logic is in
# bench/gpu_check.py; docs/gpu-validation.md says what each check does.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, installed or not
exec "$PYTHON" bench/gpu_check.py "$@"
