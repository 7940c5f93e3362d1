#!/usr/bin/env bash
# The main job, set-up included: `./scripts/main.sh`.
# SmolLM2-135M-Instruct with its shipped MTP head (trained by ./scripts/train_smollm2_head.sh) decodes a held-out
# HumanEval task with tree speculation, then plain decoding runs too and the two outputs are compared.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
CLI=.venv/bin/sglang-spec
# HumanEval/130, held out from the head's training traffic (tasks 0-119), asked the way the traffic asked
PROMPT=$(.venv/bin/python -c 'from sglang_spec.train.prompts import humaneval_prompts; print(humaneval_prompts(130, 130)[0].messages[0]["content"])')

echo "== Sequoia tree from the shipped head's calibrated profile: 16 draft nodes, depth 5 =="
$CLI tree --policy sequoia --budget 16 --depth 5 --acceptance sglang_spec/data/profiles/smollm2-135m-instruct.json
echo
echo "== SmolLM2 + shipped head, Sequoia tree (budget 16, depth 5), greedy, checked against plain decoding =="
$CLI generate --model smollm2 --policy sequoia --budget 16 --depth 5 --max-new-tokens 128 --check --prompt "$PROMPT"
echo
echo "== the same task with a hybrid tree: the head's top-k and the context's n-gram copies in one tree (16 nodes) =="
$CLI generate --model smollm2 --policy hybrid --max-new-tokens 128 --check --prompt "$PROMPT"
echo
echo "== --auto: each step's tree (context, head, both: up to 32 nodes) or none, from this machine's cost curve =="
$CLI generate --model smollm2 --auto --max-new-tokens 128 --check --prompt "$PROMPT"
