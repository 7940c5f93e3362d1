"""Head quality on every held-out prompt (greedy): the baseline metrics of a head without the speed sweep.

    python bench/head_quality.py                      # both shipped SmolLM2 heads, HumanEval 120-163, 32 tokens

Depth-1 top-1/4/8 acceptance (calibrated on plain decoding's own completions of the prompts), chain-4 accept
length and the accept lengths of Sequoia and SpecExec trees of 16 / 32 / 168 nodes: the same measurement as
``bench/acceptance.py``'s head-quality table (both use ``bench/harness.py``), over more prompts because it times
nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import REPO, head_quality, load_heads, load_profiles, load_prompt_tokens

from sglang_spec.catalog import load_model
from sglang_spec.decode.decoder import GenerationConfig, generate_plain
from sglang_spec.errors import SpecError, exit_status
from sglang_spec.files import check_output_path, write_text_atomic
from sglang_spec.sampling import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--heads", default="code,generic", help="shipped head names, comma-separated")
    parser.add_argument("--prompts", default="humaneval:120-163")
    parser.add_argument("--num-prompts", type=int, default=44)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tree-sizes", default="16,32,168")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "head-quality.json")
    args = parser.parse_args(argv)
    check_output_path(args.out, force=True)  # a bad --out fails now, not after the run

    loaded = load_model(args.model)
    heads = load_heads(loaded, None)
    wanted = args.heads.split(",")
    missing = [name for name in wanted if name not in heads]
    if missing:
        raise SpecError(f"no shipped head named {', '.join(missing)}; choose from {', '.join(heads)}")
    prompts, ids = load_prompt_tokens(loaded, args.prompts, args.num_prompts, 0)
    profiles = load_profiles(loaded, heads, None, [0.0])
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=0.0),
                              eos_token_ids=loaded.eos_token_ids)
    plain = generate_plain(loaded.model, prompts, config)
    quality = {}
    for name in wanted:
        quality[name] = head_quality(loaded, heads[name], prompts, plain, profiles[(name, 0.0)],
                                     [int(size) for size in args.tree_sizes.split(",")], config)
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in quality[name].items()}),
              flush=True)
    command = " ".join(["python", "bench/head_quality.py", *(argv or sys.argv[1:])])
    report = {"command": command, "prompts": ids, "max_new_tokens": args.max_new_tokens, "head_quality": quality}
    write_text_atomic(args.out, json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
