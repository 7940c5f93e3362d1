#!/usr/bin/env bash
# Reproduces the per-source counts (the `sources` section) of the shipped profiles for SmolLM2 + its shipped code head: greedy and
# T=0.7 decoding of prompts from the heads' own training sets (never HumanEval 120-163 nor bench/workloads/),
# counting every offered candidate's outcome. Greedy: every 4th of HumanEval 0-119 and every 20th chatterbot
# question, 96 tokens (~14 min on a busy 2-core CPU); T=0.7 (sampled verification is slower): every 8th and every
# 40th, 64 tokens (~9 min).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
OUT=sglang_spec/data/profiles
.venv/bin/sglang-spec calibrate --model smollm2 --prompts humaneval:0-119@4 --prompts chatterbot@20 \
    --temperature 0 --update "$OUT/smollm2-135m-instruct.json" --out "$OUT/smollm2-135m-instruct.json" --force
.venv/bin/sglang-spec calibrate --model smollm2 --prompts humaneval:0-119@8 --prompts chatterbot@40 \
    --max-new-tokens 64 --temperature 0.7 --update "$OUT/smollm2-135m-instruct-t0.7.json" \
    --out "$OUT/smollm2-135m-instruct-t0.7.json" --force
