#!/usr/bin/env bash
# The main job, set-up included: `./scripts/main.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
echo "== Sequoia tree for the built-in profile: 16 draft nodes, depth 5 =="
.venv/bin/sglang-spec tree --policy sequoia --budget 16 --depth 5
echo
echo "== the same budget as a chain, an EAGLE-2 tree and a SpecExec tree (expected accept length) =="
for policy in chain eagle specexec; do
    .venv/bin/sglang-spec tree --policy "$policy" --budget 16 --depth 5 --json |
        .venv/bin/python -c 'import json,sys; d=json.load(sys.stdin); print(f"{d[\"policy\"]:>9}: {d[\"num_nodes\"]-1:3d} nodes, depth {d[\"tree_depth\"]}, expected accept length {d[\"expected_accept_length\"]:.3f}")'
done
