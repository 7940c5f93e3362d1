#!/usr/bin/env bash
# SGLang's real server on this CPU with the sglang_spec plugin and a small model, set-up included:
#
#   ./scripts/sglang_cpu_server.sh                 # SmolLM2-135M + shipped MTP head, Sequoia 15/4/4, port 30000
#   ./scripts/sglang_cpu_server.sh --model tiny-deepseek --speculative-tree-policy specexec ...
#   ./scripts/sglang_cpu_server.sh --model smollm2 --speculative-algorithm NGRAM    # SGLang's n-gram drafts
#
# With no arguments it serves the README's tree (sequoia, budget 15, depth 4, topk 4) with metrics on. Any
# arguments replace that default and go to python -m sglang_spec_testbed (and from there to
# python -m sglang.launch_server). Try it:
#   curl -s localhost:30000/generate -H 'Content-Type: application/json' \
#        -d '{"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 32, "temperature": 0}}'
#   curl -s localhost:30000/metrics | grep sglang_spec
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [[ $# -eq 0 ]]; then
    set -- --model smollm2 --port 30000 --enable-metrics --speculative-tree-policy sequoia \
        --speculative-tree-budget 15 --speculative-tree-depth 4 --speculative-tree-topk 4
fi
exec .venv/bin/python -m sglang_spec_testbed "$@"
