#!/usr/bin/env bash
# A small model with an MTP layer on one GPU (MiMo-7B ships one), tree speculation with SpecExec-style selection.
# Not run by this project (no GPU for this task); see docs/gpu-validation.md.
set -euo pipefail
MODEL=${MODEL:-XiaomiMiMo/MiMo-7B-RL}
python -m sglang.launch_server \
    --model-path "$MODEL" --trust-remote-code \
    --speculative-algorithm NEXTN \
    --speculative-tree-policy specexec \
    --speculative-tree-budget 8 --speculative-tree-depth 4 --speculative-tree-topk 4 \
    --attention-backend flashinfer \
    --host 127.0.0.1 --port 30000 "$@"
