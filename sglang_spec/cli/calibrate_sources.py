"""``sglang-spec calibrate-sources``: measure how often each hybrid-tree source's candidates are accepted (the
calibration ``--policy lookup | hybrid`` and ``--auto`` start from)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sglang_spec.catalog import load_model
from sglang_spec.decode.decoder import GenerationConfig
from sglang_spec.errors import SpecError
from sglang_spec.models.registry import load_head_for
from sglang_spec.sampling import SamplingParams
from sglang_spec.train.calibrate_sources import calibrate_sources
from sglang_spec.train.generate_traffic import prompt_tokens
from sglang_spec.train.prompts import load_prompts


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "calibrate-sources",
        help="measure the per-source acceptance of hybrid trees (context lookup, MTP head, both)",
        description="Decodes prompts with a wide hybrid tree and counts, for every candidate offered at an accepted "
        "node, whether it was the accepted child: per lookup match length and rank, per head depth and draft "
        "probability, per match length where both sources agree. Use prompts your benchmarks never see.",
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--mtp", default=None, help="head (default: the model's own or shipped head)")
    parser.add_argument("--prompts", action="append", required=True, metavar="SET[@N]",
                        help="prompt set (humaneval:A-B, chatterbot, or a file), @N keeps every N-th; repeatable")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True, help="calibration JSON to write")
    parser.add_argument("--force", action="store_true")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.force:
        raise SpecError(f"{args.out} exists; pass --force to overwrite it")
    sampling = SamplingParams(temperature=args.temperature)
    sets = []
    for item in args.prompts:
        name, _, every = item.partition("@")
        if every and (not every.isdigit() or int(every) < 1):
            raise SpecError(f"--prompts {item}: after @ give a whole number >= 1 (keep every N-th prompt)")
        sets.append((name, int(every or 1)))
    loaded = load_model(args.model)
    head = load_head_for(loaded, args.mtp)
    prompts = [prompt_tokens(loaded, spec) for name, every in sets for spec in load_prompts(name)[::every]]
    if not prompts:
        raise SpecError("no prompts to calibrate on")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling,
                              eos_token_ids=loaded.eos_token_ids)
    calibration = calibrate_sources(loaded, head, prompts, config)
    obj = {**calibration.to_obj(), "model": loaded.name, "prompts": args.prompts, "temperature": args.temperature,
           "max_new_tokens": args.max_new_tokens}
    args.out.write_text(json.dumps(obj) + "\n")
    print(f"wrote {args.out} ({len(prompts)} prompts)")
    return 0
