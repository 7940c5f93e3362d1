#!/usr/bin/env bash
# The test suite, set-up included: `./scripts/test.sh [pytest args]`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export SGLANG_SPEC_REQUIRE_SGLANG=1  # sglang conformance tests must run here, never skip
exec .venv/bin/python -m pytest "$@"
