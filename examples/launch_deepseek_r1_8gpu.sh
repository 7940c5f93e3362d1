#!/usr/bin/env bash
# DeepSeek-R1 on one node of 8 GPUs with MTP tree speculation (R1's own MTP layer drafts the tree).
#
#   ./launch_deepseek_r1_8gpu.sh            # a SpecExec tree: best-first per request, needs no profile
#
# Sequoia's static tree needs an acceptance profile. Measure it on the running server's own traffic (the plugin
# counts per-depth, per-rank acceptance with --enable-metrics; R1 is never loaded outside the server), then
# relaunch with it (the later --speculative-tree-policy wins):
#
#   sglang-spec calibrate --from-server http://127.0.0.1:30000 --out r1-profile.json
#   ./launch_deepseek_r1_8gpu.sh --speculative-tree-policy sequoia --speculative-acceptance-profile r1-profile.json
#
# The counters run from the server's start, warm-up included; `sglang-spec calibrate --from-server URL --update
# r1-profile.json --out new.json` refreshes a profile and keeps its other sections.
#
# Attention: FlashInfer's MLA kernels take no tree mask, so --speculative-tree-mla-verify flashinfer verifies each
# tree as a cascade (FlashInfer's paged MLA decode over the prefix and the project's tree kernel over the tree,
# merged by log-sum-exp), and the MTP draft decodes its tree on a back-end that takes trees (fa3 here, or triton).
# The cascade needs an unquantized KV cache. On Hopper, --attention-backend fa3 alone verifies MLA trees too: drop
# --speculative-tree-mla-verify and --speculative-draft-attention-backend then.
#
# Load: --speculative-tree-auto (a tree or a plain step per batch, by measured rates) is refused at --tp-size > 1,
# since each rank would decide from its own timings; at TP 8 the tree is fixed whatever the load, so pick the budget
# for the concurrency you serve (docs/sglang-plugin.md, "Tuning").
#
# Not run by this project on a GPU (docs/gpu-validation.md): the MLA cascade passed below the server on an H200;
# the server itself has not run there. The tests check every flag here against SGLang's parser.
set -euo pipefail
MODEL=${MODEL:-deepseek-ai/DeepSeek-R1}
python -m sglang.launch_server \
    --model-path "$MODEL" --tp-size 8 --trust-remote-code \
    --speculative-algorithm NEXTN --speculative-tree-policy specexec \
    --speculative-tree-budget 15 --speculative-tree-depth 4 --speculative-tree-topk 4 \
    --attention-backend flashinfer --speculative-tree-mla-verify flashinfer \
    --speculative-draft-attention-backend fa3 --page-size 1 \
    --enable-metrics --reasoning-parser deepseek-r1 \
    --host 0.0.0.0 --port 30000 "$@"
