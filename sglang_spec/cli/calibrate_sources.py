"""``sglang-spec calibrate-sources``: measure how often each hybrid-tree source's candidates are accepted (the
calibration ``--policy lookup | hybrid`` and ``--auto`` start from)."""

from __future__ import annotations

import argparse

from sglang_spec.catalog import load_model
from sglang_spec.cli.parser import TEMPERATURE_HELP, integer, path_arg, temperature, text_arg
from sglang_spec.decode.decoder import GenerationConfig
from sglang_spec.errors import SpecError, brief
from sglang_spec.files import check_output_path, write_json_atomic
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
    parser.add_argument("--model", required=True, type=text_arg)
    parser.add_argument("--mtp", default=None, type=text_arg, help="head (default: the model's own or shipped head)")
    parser.add_argument("--prompts", action="append", required=True, metavar="SET[@N]", type=text_arg,
                        help="prompt set (humaneval:A-B, chatterbot, or a file), @N keeps every N-th; repeatable")
    parser.add_argument("--max-new-tokens", type=integer(1, MAX_NEW_TOKENS), default=96,
                        help=f"tokens decoded per prompt (1-{MAX_NEW_TOKENS}; at most the model's context minus the "
                        "longest prompt)")
    parser.add_argument("--temperature", type=temperature, default=0.0, help=TEMPERATURE_HELP)
    parser.add_argument("--out", type=path_arg, required=True, help="calibration JSON to write")
    parser.add_argument("--force", action="store_true", help="overwrite --out (atomically: a failed run keeps it)")
    parser.add_argument("--allow-model-mismatch", action="store_true",
                        help="use an --mtp head trained for another model (its metadata names the model)")
    parser.set_defaults(run=run)


MAX_NEW_TOKENS = 100_000


def run(args: argparse.Namespace) -> int:
    check_output_path(args.out, args.force)  # before any model loads
    sampling = SamplingParams(temperature=args.temperature)
    sets = []
    for item in args.prompts:
        name, _, every = item.partition("@")
        if every and (not every.isascii() or not every.isdigit() or len(every) > 9 or int(every) < 1):
            raise SpecError(f"--prompts {brief(item)}: after @ give a whole number in 1..999999999 (keep every N-th "
                            "prompt)")
        sets.append((name, int(every or 1)))
    specs = [spec for name, every in sets for spec in load_prompts(name)[::every]]  # a bad file fails here
    loaded = load_model(args.model)
    head = load_head_for(loaded, args.mtp, allow_model_mismatch=args.allow_model_mismatch)
    prompts = [prompt_tokens(loaded, spec) for spec in specs]
    if not prompts:
        raise SpecError("no prompts to calibrate on")
    loaded.check_lengths([len(prompt) for prompt in prompts], args.max_new_tokens)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling,
                              eos_token_ids=loaded.eos_token_ids)
    calibration = calibrate_sources(loaded, head, prompts, config)
    obj = {**calibration.to_obj(), "model": loaded.name, "prompts": args.prompts, "temperature": args.temperature,
           "max_new_tokens": args.max_new_tokens}
    write_json_atomic(args.out, obj)
    print(f"wrote {args.out} ({len(prompts)} prompts)")
    return 0
