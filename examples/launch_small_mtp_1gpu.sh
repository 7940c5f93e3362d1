#!/usr/bin/env bash
# A small model with its own MTP layer on one GPU (MiMo-7B ships one), with a SpecExec tree: best-first per
# request by the head's cumulative draft probability, 8 draft tokens, no acceptance profile needed.
#
#   ./launch_small_mtp_1gpu.sh
#   ./launch_small_mtp_1gpu.sh --speculative-tree-auto
#
# The second form plans every decode step for the running batch: the whole tree or a plain step (SpecExec's trees
# grown on the device are verified whole; lookup / hybrid trees can also be cut to a smaller verify size), so under
# load it falls back to plain steps. Each verify size gets its own decode CUDA graphs. With --enable-metrics, `sglang-spec calibrate --from-server http://127.0.0.1:30000 --out profile.json`
# measures a profile for --speculative-tree-policy sequoia --speculative-acceptance-profile profile.json.
#
# Not run by this project on a GPU (docs/gpu-validation.md); the tests check every flag here against SGLang's
# parser.
set -euo pipefail
MODEL=${MODEL:-XiaomiMiMo/MiMo-7B-RL}
python -m sglang.launch_server \
    --model-path "$MODEL" --trust-remote-code \
    --speculative-algorithm NEXTN \
    --speculative-tree-policy specexec \
    --speculative-tree-budget 8 --speculative-tree-depth 4 --speculative-tree-topk 4 \
    --attention-backend flashinfer --enable-metrics \
    --host 127.0.0.1 --port 30000 "$@"
