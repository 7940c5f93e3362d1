#!/usr/bin/env bash
# DeepSeek-R1 on one node of 8 GPUs with MTP tree speculation (R1's own MTP layer drafts the tree).
#
#   ./launch_deepseek_r1_8gpu.sh            # hybrid trees (the MTP head's branches and the context's copies),
#                                           # each step's size planned for the batch
#
# The trees rank their candidates by per-source counts the server learns online. Measure a profile on the running
# server's own traffic (the plugin counts per-depth, per-rank and per-source acceptance with --enable-metrics; R1
# is never loaded outside the server), then relaunch with it, so a fresh server starts from what this one learnt:
#
#   sglang-spec calibrate --from-server http://127.0.0.1:30000 --out r1-profile.json
#   ./launch_deepseek_r1_8gpu.sh --speculative-acceptance-profile r1-profile.json
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
# Load: --speculative-tree-auto plans every decode step for the running batch: how many of each request's best tree
# nodes to verify (a plain step under load), from each request's tree, a cost table SGLang's own dummy forward
# measures at start-up for every batch size and verify size, and the served steps; the 8 ranks agree on each plan.
# --speculative-tree-step-cap bounds a tree step at that many plain steps' time (the longest gap a streaming client
# sees). Each verify size gets its own CUDA graphs (SGLang's adaptive runtime states); the hybrid trees are verified
# ragged (each request's forward covers its own tree, not the fillers that pad it to the step's width) on SGLang's
# ragged verify graphs, one a tier of total verify tokens. /metrics shows the sizes chosen
# (sglang_spec_planner_verify_tokens), the verify tokens computed against SGLang's width and the predicted against
# the served step time.
#
# Not run by this project on a GPU (docs/gpu-validation.md): the MLA cascade passed below the server on an H200;
# the server itself, the planner's per-size graphs and the ragged verify graphs have not run there
# (scripts/gpu_check.sh --group server-mla checks them, at one GPU, on a lent machine). The tests check every flag
# here against SGLang's parser.
set -euo pipefail
MODEL=${MODEL:-deepseek-ai/DeepSeek-R1}
python -m sglang.launch_server \
    --model-path "$MODEL" --tp-size 8 --trust-remote-code \
    --speculative-algorithm NEXTN --speculative-tree-policy hybrid \
    --speculative-tree-budget 15 --speculative-tree-depth 8 --speculative-tree-topk 4 \
    --speculative-tree-auto --speculative-tree-step-cap 2 \
    --attention-backend flashinfer --speculative-tree-mla-verify flashinfer \
    --speculative-draft-attention-backend fa3 --page-size 1 \
    --enable-metrics --reasoning-parser deepseek-r1 \
    --host 0.0.0.0 --port 30000 "$@"
