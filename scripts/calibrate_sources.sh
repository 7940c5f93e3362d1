#!/usr/bin/env bash
# Reproduces the shipped per-source calibrations of hybrid trees for SmolLM2 + its shipped code head: greedy and
# T=0.7 decoding of prompts from the heads' own training sets (every 4th of HumanEval 0-119, every 20th chatterbot
# question; never HumanEval 120-163 nor bench/workloads/), counting every offered candidate's outcome.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
OUT=sglang_spec/data/profiles
for temperature in 0 0.7; do
    suffix=""; [[ $temperature != 0 ]] && suffix="-t$temperature"
    .venv/bin/sglang-spec calibrate-sources --model smollm2 --prompts humaneval:0-119@4 --prompts chatterbot@20 \
        --temperature "$temperature" --out "$OUT/smollm2-135m-instruct-sources$suffix.json" --force
done
