#!/usr/bin/env bash
# Reproduces the shipped SmolLM2-135M-Instruct MTP heads and their acceptance profiles, from nothing but the
# installed packages: `./scripts/train_smollm2_head.sh` (a few hours on a 2-core CPU; runs/ holds everything).
#
#   1. traffic: SmolLM2's own completions (greedy + sampled at T=0.8) for HumanEval tasks 0-119 and the English
#      chatterbot-corpus prompts, plus their reference answers as extra teacher-forced text;
#      HumanEval 120-163 is never used here (held out for evaluation);
#   2. generic head: trained on the chat traffic only;
#   3. code head (the default shipped head): the generic head fine-tuned on the code traffic;
#   4. profiles: each head calibrated at temperature 0 and 0.7 on the prompts its training held out.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
RUN=${RUN:-runs/smollm2}
GENERIC_STEPS=${GENERIC_STEPS:-600}
CODE_STEPS=${CODE_STEPS:-300}
CLI=.venv/bin/sglang-spec
mkdir -p "$RUN"

[[ -f "$RUN/code.jsonl" ]] || $CLI traffic generate --model smollm2 --prompts humaneval:0-119 --samples 4 \
    --temperature 0.8 --max-new-tokens 320 --batch-size 40 --reference --seed 1 --out "$RUN/code.jsonl"
[[ -f "$RUN/chat.jsonl" ]] || $CLI traffic generate --model smollm2 --prompts chatterbot --samples 2 \
    --temperature 0.8 --max-new-tokens 160 --batch-size 64 --reference --seed 2 --out "$RUN/chat.jsonl"

train() {  # resumes an interrupted run, otherwise starts one
    local out=$1; shift
    if [[ -f "${out%.safetensors}.state.pt" ]]; then $CLI train "$@" --out "$out" --resume; else $CLI train "$@" --out "$out" --force; fi
}
train "$RUN/generic.safetensors" --model smollm2 --traffic "$RUN/chat.jsonl" --steps "$GENERIC_STEPS" --batch-size 16 \
    --draft-vocab 8192 --unroll 4 --seq-len 512 --lr 1e-3 --bf16 --save-dtype bfloat16
train "$RUN/code.safetensors" --model smollm2 --traffic "$RUN/code.jsonl" --init "$RUN/generic.safetensors" \
    --steps "$CODE_STEPS" --draft-vocab 8192 --unroll 4 --batch-size 8 --seq-len 512 --lr 5e-4 --bf16 \
    --save-dtype bfloat16

# profiles are measured on the prompts training held out (its 5% eval split, by prompt): calibrating on what the
# head was trained on overstates its acceptance (docs/training.md shows by how much)
for head in generic code; do
    traffic=$RUN/chat.jsonl; [[ $head == code ]] && traffic=$RUN/code.jsonl
    $CLI calibrate --model smollm2 --mtp "$RUN/$head.safetensors" --traffic "$traffic" --held-out 0.05 \
        --max-records 120 --depth 6 --max-rank 8 --temperature 0 --out "$RUN/$head.json" --force
    $CLI calibrate --model smollm2 --mtp "$RUN/$head.safetensors" --traffic "$traffic" --held-out 0.05 \
        --max-records 120 --depth 6 --max-rank 8 --temperature 0.7 --out "$RUN/$head-t0.7.json" --force
done

HEADS=sglang_spec/data/heads
PROFILES=sglang_spec/data/profiles
mkdir -p "$HEADS"
cp "$RUN/code.safetensors" "$HEADS/smollm2-135m-instruct.safetensors"
cp "$RUN/generic.safetensors" "$HEADS/smollm2-135m-instruct-generic.safetensors"
cp "$RUN/code.json" "$PROFILES/smollm2-135m-instruct.json"
cp "$RUN/code-t0.7.json" "$PROFILES/smollm2-135m-instruct-t0.7.json"
cp "$RUN/generic.json" "$PROFILES/smollm2-135m-instruct-generic.json"
cp "$RUN/generic-t0.7.json" "$PROFILES/smollm2-135m-instruct-generic-t0.7.json"
echo "installed the heads in $HEADS and the profiles in $PROFILES"
# the code head's profiles also carry per-source counts for lookup / hybrid trees, measured with the head installed
./scripts/calibrate_sources.sh
