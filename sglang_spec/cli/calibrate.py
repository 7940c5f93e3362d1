"""``sglang-spec calibrate``: measure an acceptance profile, the one file every tree policy reads: the head's
per-depth, per-rank table from traffic (``--traffic``) or from a live SGLang server's counters (``--from-server``),
and the per-source counts of lookup / hybrid trees by decoding prompts (``--prompts``); ``--update`` keeps the
sections not measured now."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from sglang_spec.catalog import load_model
from sglang_spec.cli.parser import TEMPERATURE_HELP, integer, path_arg, temperature, text_arg
from sglang_spec.decode.decoder import GenerationConfig
from sglang_spec.errors import SpecError, brief
from sglang_spec.files import check_output_path, write_json_atomic
from sglang_spec.models.loading import load_head_for
from sglang_spec.sampling import SamplingParams
from sglang_spec.train.calibrate import calibrate, calibrate_sources
from sglang_spec.train.server_counts import parse_rank_counts, parse_source_counts, rank_rows
from sglang_spec.train.generate_traffic import prompt_tokens
from sglang_spec.train.prompts import PROMPT_SETS, PromptSpec, load_prompts
from sglang_spec.train.records import encode_record, is_eval_record
from sglang_spec.train.traffic import TrafficRecord, check_traffic_model, read_traffic_strict
from sglang_spec.tree.policies import MAX_TOPK
from sglang_spec.tree.profile import AcceptanceProfile, SourceCounts
from sglang_spec.tree.token_tree import MAX_DEPTH

CALIBRATION_SEQ_LEN = 512  # tokens of a traffic record (prompt + completion) the positional table reads

MAX_NEW_TOKENS = 100_000


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "calibrate",
        help="measure an acceptance profile (the JSON every tree policy reads)",
        description="--traffic: drafts along the target's own completions and records, per depth and rank, how "
        "often (temperature 0) or how likely (temperature > 0) the head's rank-k candidate is the accepted token "
        "(the positional table of sequoia trees and --auto). --prompts: decodes prompts with a wide hybrid tree and "
        "counts, for every candidate offered at an accepted node, whether it was the accepted child, per lookup "
        "match length and rank, head depth and draft probability, and match length where both sources agree (the "
        "per-source counts of lookup / hybrid trees). --from-server URL: reads the per-depth, per-rank acceptance "
        "a live SGLang server with the sglang_spec plugin and --enable-metrics counted on its own traffic (for targets "
        "that transformers cannot load); the server counts the MTP head's tree nodes only, so per-source counts "
        "(lookup / hybrid) are not served yet. Use prompts and traffic your benchmarks never see.",
    )
    parser.add_argument("--model", default=None, type=text_arg,
                        help="the target model (needed by --traffic and --prompts)")
    parser.add_argument("--from-server", default=None, type=text_arg, metavar="URL",
                        help="positional table from a live server's /metrics (launched with the plugin and "
                        "--enable-metrics), e.g. http://127.0.0.1:30000; not with --traffic")
    parser.add_argument("--mtp", default=None, type=text_arg,
                        help="head to calibrate (default: the model's own or shipped head)")
    parser.add_argument("--traffic", type=path_arg, action="append", default=None,
                        help="traffic JSONL for the positional table; repeatable")
    parser.add_argument("--prompts", action="append", default=None, metavar="SET[@N]", type=text_arg,
                        help=f"prompts for the per-source counts ({PROMPT_SETS}), @N keeps every N-th; repeatable")
    parser.add_argument("--max-new-tokens", type=integer(1, MAX_NEW_TOKENS), default=96,
                        help=f"--prompts: tokens decoded per prompt (1-{MAX_NEW_TOKENS}; at most the model's context "
                        "minus the longest prompt)")
    parser.add_argument("--update", type=path_arg, default=None, metavar="PROFILE.json",
                        help="keep this profile's sections that are not measured now (e.g. add --prompts counts to "
                        "a profile measured from traffic)")
    parser.add_argument("--domain", action="append", default=None, type=text_arg, help="keep only these domains")
    parser.add_argument("--greedy-only", action="store_true",
                        help="use only greedy completions (temperature-0 paths; recommended for --temperature 0)")
    parser.add_argument("--held-out", type=float, default=None, metavar="EVAL_FRACTION",
                        help="keep only the records `sglang-spec train --eval-fraction EVAL_FRACTION` held out from "
                        "training (same split by prompt), so the profile is not measured on what the head learned; "
                        "pass the training run's fraction (its default is 0.05)")
    parser.add_argument("--max-records", type=int, default=0,
                        help="calibrate on at most this many records, an evenly spaced subset (0 = all)")
    parser.add_argument("--depth", type=integer(1, MAX_DEPTH), default=None,
                        help=f"draft depths measured (1-{MAX_DEPTH}; default 6, --from-server: all the server saw)")
    parser.add_argument("--max-rank", type=integer(1, MAX_TOPK), default=None,
                        help=f"candidate ranks measured per depth (1-{MAX_TOPK}, at most the head's draft "
                        f"vocabulary; default 8, --from-server: all the server saw)")
    parser.add_argument("--temperature", type=temperature, default=0.0, help=TEMPERATURE_HELP)
    parser.add_argument("--out", type=path_arg, required=True, help="profile JSON to write")
    parser.add_argument("--force", action="store_true", help="overwrite --out (atomically: a failed run keeps it)")
    parser.add_argument("--allow-model-mismatch", action="store_true",
                        help="calibrate on traffic, or a head, made for another model")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.from_server is not None:
        return run_from_server(args)
    args.depth = 6 if args.depth is None else args.depth
    args.max_rank = 8 if args.max_rank is None else args.max_rank
    # options first, so a typo fails before the traffic is read or a model loads
    if args.model is None:
        raise SpecError("--traffic and --prompts need --model (the target to calibrate)")
    if not args.traffic and not args.prompts:
        raise SpecError("give --traffic or --from-server (the head's positional table), --prompts (per-source "
                        "counts), or --traffic and --prompts")
    if not args.traffic and args.update is None:
        raise SpecError("--prompts alone measures only the per-source counts; give --traffic too, or --update "
                        "PROFILE.json to keep that profile's positional table")
    if args.held_out is not None and not 0 < args.held_out < 1:
        raise SpecError(f"--held-out takes the training run's eval fraction in (0, 1), got {args.held_out}")
    if args.max_records < 0:
        raise SpecError(f"--max-records must be >= 0, got {args.max_records}")
    check_output_path(args.out, args.force)
    base = AcceptanceProfile.load(args.update) if args.update is not None else None
    records = _records(args) if args.traffic else []
    specs = _prompt_specs(args.prompts) if args.prompts else []  # a bad file fails here
    loaded = load_model(args.model)
    if records:
        warning = check_traffic_model(records, loaded.name, args.allow_model_mismatch)
        if warning:
            print(warning, file=sys.stderr)
    head = load_head_for(loaded, args.mtp, allow_model_mismatch=args.allow_model_mismatch)
    if records and args.max_rank > head.draft_vocab_size:
        raise SpecError(f"--max-rank {args.max_rank} exceeds the head's draft vocabulary of "
                        f"{head.draft_vocab_size} tokens")
    prompts = [prompt_tokens(loaded, spec) for spec in specs]
    if specs:
        loaded.check_lengths([len(prompt) for prompt in prompts], args.max_new_tokens)
    if records:
        result = calibrate(loaded, head, [encode_record(loaded, record, CALIBRATION_SEQ_LEN) for record in records],
                           depth=args.depth, max_rank=args.max_rank, temperature=args.temperature)
        metadata = dict(result.profile.metadata)
        metadata.update({"model": loaded.name, "head": args.mtp or "default", "traffic": [str(p) for p in args.traffic],
                         "domains": args.domain, "records": len(records),
                         "held_out": args.held_out, "greedy_only": args.greedy_only})
        profile = AcceptanceProfile(result.profile.rank_acceptance, metadata,
                                    sources=None if base is None else base.sources)
    else:
        assert base is not None
        profile = base
    obj = profile.to_obj()
    if prompts:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(args.temperature),
                                  eos_token_ids=loaded.eos_token_ids)
        counts = calibrate_sources(loaded, head, prompts, config)
        # where the counts came from, inside their section (the parser reads only the count tables)
        obj["sources"] = {**counts.to_obj(), "model": loaded.name, "prompts": args.prompts,
                          "temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
    write_json_atomic(args.out, obj)
    print(f"wrote {args.out} at temperature {args.temperature}: "
          + ", ".join(part for part in (f"positional table from {len(records)} records" if records else "",
                                        f"per-source counts from {len(prompts)} prompts" if prompts else "") if part))
    if records:
        for depth, (row, count) in enumerate(zip(result.profile.rank_acceptance, result.positions), start=1):
            print(f"  depth {depth}: rank-1 {row[0]:.3f}, top-{len(row)} {sum(row):.3f} ({count} positions)")
    return 0


def _records(args: argparse.Namespace) -> list[TrafficRecord]:
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
    return records


def _prompt_specs(items: list[str]) -> list[PromptSpec]:
    sets = []
    for item in items:
        name, _, every = item.partition("@")
        if every and (not every.isascii() or not every.isdigit() or len(every) > 9 or int(every) < 1):
            raise SpecError(f"--prompts {brief(item)}: after @ give a whole number in 1..999999999 (keep every N-th "
                            "prompt)")
        sets.append((name, int(every or 1)))
    specs = [spec for name, every in sets for spec in load_prompts(name)[::every]]
    if not specs:
        raise SpecError("no prompts to calibrate on")
    return specs


# ------------------------------------------------------------------------------------------------- --from-server
def run_from_server(args: argparse.Namespace) -> int:
    if args.traffic or args.prompts:
        raise SpecError("--from-server reads the server's counts (its positional table, and a lookup / hybrid "
                        "server's per-source counts); run --traffic or --prompts (with --model) separately, with "
                        "--update")
    check_output_path(args.out, args.force)
    base = AcceptanceProfile.load(args.update) if args.update is not None else None
    url = args.from_server.rstrip("/")
    text = fetch_metrics(url)
    steps, offered, accepted = parse_rank_counts(text, url)
    rows, counted = rank_rows(offered, accepted, args.depth or MAX_DEPTH, args.max_rank or MAX_TOPK)
    if not rows:
        raise SpecError(f"{url}: no draft node was offered at an accepted node yet; send requests first")
    metadata = {"from_server": url, "steps": steps, "offered": counted}
    profile = AcceptanceProfile.from_obj({"rank_acceptance": [list(row) for row in rows], **metadata},
                                         f"{url} counts")
    sources = None if base is None else base.sources
    observed = parse_source_counts(text)
    if observed:  # lookup / hybrid served: their online outcomes on top of the prior the table had
        prior = sources if sources is not None else SourceCounts.generic()
        sources = prior.with_observed(observed, f"{url} counts")
    obj = profile.with_sources(sources).to_obj()
    write_json_atomic(args.out, obj)
    print(f"wrote {args.out}: positional table from {steps} verify steps of {url}")
    if observed:
        candidates = sum(count for _, count in observed.values())
        print(f"  sources: {int(candidates)} lookup / head candidates observed in {len(observed)} cells")
    for depth, (row, count) in enumerate(zip(rows, counted), start=1):
        print(f"  depth {depth}: rank-1 {row[0]:.3f}, top-{len(row)} {sum(row):.3f} ({count} nodes offered)")
    return 0


def fetch_metrics(url: str, timeout: float = 10.0) -> str:
    """The server's Prometheus text; every failure is one line."""
    if not url.startswith(("http://", "https://")):
        raise SpecError(f"--from-server {brief(url)}: give the server's URL, e.g. http://127.0.0.1:30000")
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
            return response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as error:
        if error.code == 404:
            raise SpecError(f"{url}/metrics: not found (404); launch the server with --enable-metrics") from None
        raise SpecError(f"{url}/metrics: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise SpecError(f"cannot reach {url}/metrics: {reason}") from None
