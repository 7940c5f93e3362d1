#!/usr/bin/env bash
# The test suite, set-up included: `./scripts/test.sh [pytest args]`. The type check runs first (mypy over
# sglang_spec/, configured in pyproject.toml, cached in .mypy_cache/: a few seconds once warm).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/python -m mypy
export SGLANG_SPEC_REQUIRE_SGLANG=1  # sglang conformance tests must run here, never skip
export SGLANG_SPEC_REQUIRE_SMALL_GEMM=1  # this machine has AVX-512 and g++: the kernel's tests must run, never skip
exec .venv/bin/python -m pytest "$@"
