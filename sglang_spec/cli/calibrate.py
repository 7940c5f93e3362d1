"""``sglang-spec calibrate``: measure a head's per-depth, per-rank acceptance profile on traffic."""

from __future__ import annotations

import argparse
import sys

from sglang_spec.catalog import load_model
from sglang_spec.cli.parser import TEMPERATURE_HELP, integer, path_arg, temperature, text_arg
from sglang_spec.errors import SpecError
from sglang_spec.files import check_output_path
from sglang_spec.models.registry import load_head_for
from sglang_spec.train.calibrate import calibrate
from sglang_spec.train.records import is_eval_record
from sglang_spec.train.traffic import check_traffic_model, read_traffic_strict
from sglang_spec.tree.policies import MAX_TOPK
from sglang_spec.tree.token_tree import MAX_DEPTH


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "calibrate",
        help="measure an MTP head's acceptance profile (the JSON the sequoia policy reads)",
        description="Drafts along the target's own completions in the traffic and records, per depth and rank, how "
        "often (temperature 0) or how likely (temperature > 0) the head's rank-k candidate is the accepted token.",
    )
    parser.add_argument("--model", required=True, type=text_arg)
    parser.add_argument("--mtp", default=None, type=text_arg,
                        help="head to calibrate (default: the model's own or shipped head)")
    parser.add_argument("--traffic", type=path_arg, action="append", required=True,
                        help="traffic JSONL; repeatable")
    parser.add_argument("--domain", action="append", default=None, type=text_arg, help="keep only these domains")
    parser.add_argument("--greedy-only", action="store_true",
                        help="use only greedy completions (temperature-0 paths; recommended for --temperature 0)")
    parser.add_argument("--held-out", type=float, default=None, metavar="EVAL_FRACTION",
                        help="keep only the records `sglang-spec train --eval-fraction EVAL_FRACTION` held out from "
                        "training (same split by prompt), so the profile is not measured on what the head learned; "
                        "pass the training run's fraction (its default is 0.05)")
    parser.add_argument("--max-records", type=int, default=0,
                        help="calibrate on at most this many records, an evenly spaced subset (0 = all)")
    parser.add_argument("--depth", type=integer(1, MAX_DEPTH), default=6,
                        help=f"draft depths measured (1-{MAX_DEPTH})")
    parser.add_argument("--max-rank", type=integer(1, MAX_TOPK), default=8,
                        help=f"candidate ranks measured per depth (1-{MAX_TOPK}, at most the head's draft "
                        f"vocabulary)")
    parser.add_argument("--temperature", type=temperature, default=0.0, help=TEMPERATURE_HELP)
    parser.add_argument("--out", type=path_arg, required=True, help="profile JSON to write")
    parser.add_argument("--force", action="store_true", help="overwrite --out (atomically: a failed run keeps it)")
    parser.add_argument("--allow-model-mismatch", action="store_true",
                        help="calibrate on traffic, or a head, made for another model")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # options first, so a typo fails before the traffic is read
    if args.held_out is not None and not 0 < args.held_out < 1:
        raise SpecError(f"--held-out takes the training run's eval fraction in (0, 1), got {args.held_out}")
    if args.max_records < 0:
        raise SpecError(f"--max-records must be >= 0, got {args.max_records}")
    check_output_path(args.out, args.force)
    records = read_traffic_strict(args.traffic)
    if args.domain:
        records = [record for record in records if record.domain in args.domain]
    if args.greedy_only:
        records = [record for record in records if record.id.endswith("/greedy")]
    if args.held_out is not None:
        records = [record for record in records if is_eval_record(record.id, args.held_out)]
    if not records:
        raise SpecError("no traffic records left after filtering")
    if args.max_records and len(records) > args.max_records:
        # evenly spaced, so every prompt family and domain in the file stays represented
        stride = len(records) / args.max_records
        records = [records[int(index * stride)] for index in range(args.max_records)]
    loaded = load_model(args.model)
    warning = check_traffic_model(records, loaded.name, args.allow_model_mismatch)
    if warning:
        print(warning, file=sys.stderr)
    head = load_head_for(loaded, args.mtp, allow_model_mismatch=args.allow_model_mismatch)
    if args.max_rank > head.draft_vocab_size:
        raise SpecError(f"--max-rank {args.max_rank} exceeds the head's draft vocabulary of "
                        f"{head.draft_vocab_size} tokens")
    result = calibrate(loaded, head, records, depth=args.depth, max_rank=args.max_rank, temperature=args.temperature)
    profile = result.profile
    metadata = dict(profile.metadata)
    metadata.update({"model": loaded.name, "head": args.mtp or "default", "traffic": [str(p) for p in args.traffic],
                     "domains": args.domain, "records": len(records),
                     "held_out": args.held_out, "greedy_only": args.greedy_only})
    out = type(profile)(profile.rank_acceptance, metadata)
    out.to_json(args.out)
    print(f"wrote {args.out} from {len(records)} records at temperature {args.temperature}")
    for depth, (row, count) in enumerate(zip(profile.rank_acceptance, result.positions), start=1):
        print(f"  depth {depth}: rank-1 {row[0]:.3f}, top-{len(row)} {sum(row):.3f} ({count} positions)")
    return 0
