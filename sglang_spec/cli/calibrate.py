"""``sglang-spec calibrate``: measure a head's per-depth, per-rank acceptance profile on traffic."""

from __future__ import annotations

import argparse
from pathlib import Path

from sglang_spec.catalog import load_model
from sglang_spec.errors import SpecError
from sglang_spec.models.registry import load_head_for
from sglang_spec.train.calibrate import calibrate
from sglang_spec.train.records import is_eval_record
from sglang_spec.train.traffic import read_traffic_strict


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "calibrate",
        help="measure an MTP head's acceptance profile (the JSON the sequoia policy reads)",
        description="Drafts along the target's own completions in the traffic and records, per depth and rank, how "
        "often (temperature 0) or how likely (temperature > 0) the head's rank-k candidate is the accepted token.",
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--mtp", default=None, help="head to calibrate (default: the model's own or shipped head)")
    parser.add_argument("--traffic", type=Path, action="append", required=True, help="traffic JSONL; repeatable")
    parser.add_argument("--domain", action="append", default=None, help="keep only these domains")
    parser.add_argument("--greedy-only", action="store_true",
                        help="use only greedy completions (temperature-0 paths; recommended for --temperature 0)")
    parser.add_argument("--held-out", type=float, default=None, metavar="EVAL_FRACTION",
                        help="keep only the records `sglang-spec train --eval-fraction EVAL_FRACTION` held out from "
                        "training (same split by prompt), so the profile is not measured on what the head learned; "
                        "pass the training run's fraction (its default is 0.05)")
    parser.add_argument("--max-records", type=int, default=0,
                        help="calibrate on at most this many records, an evenly spaced subset (0 = all)")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--max-rank", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    parser.add_argument("--force", action="store_true")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # options first, so a typo fails before the traffic is read
    if args.held_out is not None and not 0 < args.held_out < 1:
        raise SpecError(f"--held-out takes the training run's eval fraction in (0, 1), got {args.held_out}")
    if args.max_records < 0:
        raise SpecError(f"--max-records must be >= 0, got {args.max_records}")
    if args.out.exists() and not args.force:
        raise SpecError(f"{args.out} exists; pass --force to overwrite it")
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
    head = load_head_for(loaded, args.mtp)
    result = calibrate(loaded, head, records, depth=args.depth, max_rank=args.max_rank, temperature=args.temperature)
    profile = result.profile
    metadata = dict(profile.metadata)
    metadata.update({"model": loaded.name, "head": args.mtp or "default", "traffic": [str(p) for p in args.traffic],
                     "domains": args.domain, "records": len(records),
                     "held_out": args.held_out, "greedy_only": args.greedy_only})
    out = type(profile)(profile.rank_acceptance, metadata)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out.to_json(args.out)
    print(f"wrote {args.out} from {len(records)} records at temperature {args.temperature}")
    for depth, (row, count) in enumerate(zip(profile.rank_acceptance, result.positions), start=1):
        print(f"  depth {depth}: rank-1 {row[0]:.3f}, top-{len(row)} {sum(row):.3f} ({count} positions)")
    return 0
