"""Accept length of hybrid tree shapes in the reference decoder, on the reference bench's own prompts: how the
context trees' default depth (``sglang_plugin/options.default_depth``) was chosen, never on the serving sweep's
held-out prompts.

    python bench/hybrid_shapes.py                                   # budget 15, depths 6-15, head levels 2-4
    python bench/hybrid_shapes.py --shapes 7:7:3,7:4:3 --max-new-tokens 32

SmolLM2 + shipped head and its T=0 profile, greedy, ``--max-new-tokens`` tokens a prompt (end-of-sequence ignored, as
the serving sweep's requests), every prompt of ``bench/workloads/{code,extraction}.jsonl``. Prints a table (shape x
workload: mean accept length) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from harness import REPO, load_prompt_tokens, markdown_table
from hybrid import sizes

from sglang_spec.catalog import load_model
from sglang_spec.cli.parser import OneLineErrorParser, comma_list, integer
from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
from sglang_spec.errors import exit_status
from sglang_spec.files import check_output_path, write_text_atomic
from sglang_spec.models.loading import load_head_for, shipped_profile_path
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile

DEFAULT_SHAPES = "15:6:3,15:8:2,15:8:3,15:8:4,15:10:3,15:10:4,15:12:3,15:15:3"
WORKLOADS = ("code", "extraction")
MAX_PROMPTS = 8  # every prompt of the two workload files (6 and 4)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=comma_list(lambda text: sizes(text, "--shapes")), default=DEFAULT_SHAPES,
                        help="BUDGET:DEPTH:MTP_LEVELS, comma-separated")
    parser.add_argument("--max-new-tokens", type=integer(1, 1024), default=48)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "hybrid_shapes.json")
    args = parser.parse_args(argv)
    check_output_path(args.out, force=True)  # a bad --out fails now, not after the run
    torch.set_num_threads(1)
    loaded = load_model("smollm2")
    head = load_head_for(loaded, None)
    profile = AcceptanceProfile.load(shipped_profile_path(loaded.name, 0.0))
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    accept_lengths: dict[str, dict[str, float]] = {}
    for workload in WORKLOADS:
        prompts, _ = load_prompt_tokens(loaded, str(REPO / "bench" / "workloads" / f"{workload}.jsonl"), MAX_PROMPTS, 0)
        for budget, depth, levels in args.shapes:
            policy = TreePolicy("hybrid", budget, depth, topk=4, mtp_levels=levels,
                                max_ngram=profile.sources.max_ngram, profile=profile)
            with torch.no_grad():
                output = SpeculativeDecoder(loaded.model, head, policy).generate(prompts, config)
            shape = f"{budget}:{depth}:{levels}"
            accept_lengths.setdefault(shape, {})[workload] = output.accept_length_mean
            print(f"{workload} {shape}: accept length {output.accept_length_mean:.3f}", flush=True)
    rows = [[shape, *(f"{row[workload]:.2f}" for workload in WORKLOADS)] for shape, row in accept_lengths.items()]
    print("\n".join(markdown_table(["budget:depth:head levels", *WORKLOADS], rows)))
    command = " ".join(["python", "bench/hybrid_shapes.py", *(argv if argv is not None else sys.argv[1:])])
    write_text_atomic(args.out, json.dumps({"command": command, "max_new_tokens": args.max_new_tokens,
                                            "accept_length": accept_lengths}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
