#!/usr/bin/env bash
# The test suite, set-up included: `./scripts/test.sh [pytest args]`. The type check runs first (mypy over
# sglang_spec/, configured in pyproject.toml, cached in .mypy_cache/: a few seconds once warm).
# Tests run on SGLANG_SPEC_TEST_WORKERS pytest-xdist workers (default 2, one a core: a server test leaves the other
# core idle), each test module on one worker; `-n 0` in the arguments runs them in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/python -m mypy
export SGLANG_SPEC_REQUIRE_SGLANG=1  # sglang conformance tests must run here, never skip
export SGLANG_SPEC_REQUIRE_SMALL_GEMM=1  # this machine has AVX-512 and g++: the kernel's tests must run, never skip
exec .venv/bin/python -m pytest -n "${SGLANG_SPEC_TEST_WORKERS:-2}" --dist loadscope "$@"
