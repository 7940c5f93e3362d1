#!/usr/bin/env bash
# DeepSeek-R1 on 8 GPUs (one node) with MTP tree speculation.
#
# 1. Calibrate an acceptance profile for R1's own MTP layer on traffic you serve (greedy completions):
#      sglang-spec calibrate --model /models/DeepSeek-R1 --traffic traffic.jsonl --greedy-only --out r1-profile.json
# 2. Launch. MLA trees verify on the fa3 (Hopper) or triton backends with page size 1; FlashInfer's MLA backend
#    cannot take a tree mask (see docs/sglang-plugin.md for the cascade design).
# Not run by this project: no 8-GPU machine was available (docs/gpu-validation.md).
set -euo pipefail
MODEL=${MODEL:-deepseek-ai/DeepSeek-R1}
PROFILE=${PROFILE:-r1-profile.json}
python -m sglang.launch_server \
    --model-path "$MODEL" --tp-size 8 --trust-remote-code \
    --speculative-algorithm NEXTN \
    --speculative-tree-policy sequoia \
    --speculative-tree-budget 15 --speculative-tree-depth 4 --speculative-tree-topk 4 \
    --speculative-acceptance-profile "$PROFILE" \
    --attention-backend fa3 --page-size 1 \
    --reasoning-parser deepseek-r1 \
    --host 0.0.0.0 --port 30000 "$@"
