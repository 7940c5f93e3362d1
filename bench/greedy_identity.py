"""Greedy identity of the reference decoder on a device: tree-speculative decoding emits exactly plain greedy
decoding's tokens, for every tree policy, one request at a time and in batches.

The target is the tiny DeepSeek-V3 architecture (MLA, MoE, one MTP layer: ``models/tiny_deepseek.py``) built from
its config with seeded random weights, and the MTP head is random too: greedy identity holds for any weights, so
nothing is trained (the toy-trained ``tiny-deepseek`` takes about half a minute of training to build). The
vocabulary is cut to 8 tokens so that a random head's top-3 still holds the target's argmax often enough for
accepted runs of several tokens; with the usual 512 a random head accepts almost nothing and the accepted-path
commits would go untested. A divergence is excused only where plain decoding's top-2 logit gap is below 1e-4
(counted in the report, never silently passed). Needs transformers (the model) and safetensors.

    python bench/greedy_identity.py                 # CUDA when present, else CPU
    python bench/greedy_identity.py --tiny          # two prompts, a few tokens (checks the harness)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from harness import REPO

from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder, compare_with_plain, generate_plain
from sglang_spec.errors import exit_status
from sglang_spec.files import check_output_path, write_json_atomic
from sglang_spec.models.tiny_deepseek import random_tiny_deepseek
from sglang_spec.mtp.head import MTPHead
from sglang_spec.tree import AcceptanceProfile, TreePolicy

VOCAB = 8
POLICIES = ("chain", "eagle", "sequoia", "specexec")
PROFILE = AcceptanceProfile.from_obj({"rank_acceptance": [[0.7, 0.15, 0.05], [0.6, 0.15, 0.05]]})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "greedy-identity.json")
    parser.add_argument("--tiny", action="store_true", help="two prompts, six tokens, batches of two")
    args = parser.parse_args(argv)
    if args.tiny:
        args.prompts, args.max_new_tokens, args.batch_sizes = 2, 6, "2"
    return args


def check_policy(model: torch.nn.Module, head: MTPHead, prompts: list[list[int]], policy_name: str,
                 config: GenerationConfig, batch_sizes: list[int], plain: list) -> dict:
    """Speculative outputs against plain ones for one policy at each batch size."""
    policy = TreePolicy(policy_name, budget=10, depth=4, topk=3, profile=PROFILE)
    decoder = SpeculativeDecoder(model, head, policy)
    result: dict = {"policy": policy_name, "diverged": 0, "excused": 0, "accept_lengths": []}
    for batch_size in batch_sizes:
        outputs = []
        for start in range(0, len(prompts), batch_size):
            outputs += decoder.generate(prompts[start : start + batch_size], config).requests
        comparisons = [compare_with_plain(ours, theirs) for ours, theirs in zip(outputs, plain)]
        result["diverged"] += sum(not c.identical and not c.excused for c in comparisons)
        result["excused"] += sum(not c.identical and c.excused for c in comparisons)
        result["accept_lengths"] += [length for request in outputs for length in request.accept_lengths]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_output_path(args.out, force=True)  # a bad --out fails now, not after the decoding
    started = time.perf_counter()
    model, head = random_tiny_deepseek(args.device, vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, size=int(rng.integers(2, 14))).tolist() for _ in range(args.prompts)]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    plain = generate_plain(model, prompts, config).requests
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    results = [check_policy(model, head, prompts, name, config, batch_sizes, plain) for name in POLICIES]
    for result in results:
        lengths = result.pop("accept_lengths")
        result["mean_accept_length"] = float(np.mean(lengths))
        result["max_accept_length"] = int(max(lengths))
        print(f"{result['policy']:>9}: {result['diverged']} diverged, {result['excused']} near-ties excused, "
              f"accept length mean {result['mean_accept_length']:.2f}, max {result['max_accept_length']}")
    diverged = sum(result["diverged"] for result in results)
    deepest = max(result["max_accept_length"] for result in results)
    # identity must also have been exercised on accepted runs, not only on bonus-only steps
    deep_enough = args.tiny or deepest >= 3
    passed = diverged == 0 and deep_enough
    detail = (f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {len(POLICIES)} policies, batch sizes "
              f"{args.batch_sizes}: {diverged} diverged, longest accepted run {deepest}")
    if not deep_enough:
        detail += " (< 3: accepted runs too short to test the commits)"
    report = {"device": str(args.device), "passed": passed, "detail": detail, "policies": results,
              "seconds": time.perf_counter() - started}
    write_json_atomic(args.out, report)
    print(("identical: " if passed else "FAILED: ") + detail)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(exit_status(main))
