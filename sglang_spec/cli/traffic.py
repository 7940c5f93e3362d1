"""``sglang-spec traffic``: build training traffic (generate with the target, or import a server's logs)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from sglang_spec.catalog import load_model
from sglang_spec.errors import SpecError
from sglang_spec.train.generate_traffic import generate_traffic
from sglang_spec.train.prompts import load_prompts
from sglang_spec.train.traffic import import_openai_chat, import_sglang_log, read_traffic, write_traffic


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser("traffic", help="generate or import traffic (JSONL, one request per line)")
    actions = parser.add_subparsers(dest="action", required=True, parser_class=type(parser))

    generate = actions.add_parser("generate", help="run the target on prompt sets and record its completions")
    generate.add_argument("--model", required=True, help="smollm2, tiny-deepseek, or a local model folder")
    generate.add_argument("--prompts", action="append", required=True,
                          help="humaneval:A-B, chatterbot, or a file (.jsonl / .txt); repeatable")
    generate.add_argument("--samples", type=int, default=1, help="sampled completions per prompt")
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--no-greedy", action="store_true", help="skip the greedy completion")
    generate.add_argument("--reference", action="store_true",
                          help="also record each prompt's reference answer (teacher-forced text for training)")
    generate.add_argument("--max-new-tokens", type=int, default=256)
    generate.add_argument("--batch-size", type=int, default=32)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--out", type=Path, required=True)
    generate.add_argument("--force", action="store_true", help="overwrite --out")
    generate.set_defaults(run=run_generate)

    importer = actions.add_parser("import", help="convert an SGLang request log or OpenAI-style chat logs")
    importer.add_argument("inputs", nargs="+", type=Path)
    importer.add_argument("--format", choices=["sglang", "openai"], required=True)
    importer.add_argument("--domain", default="imported", help="domain tag for every record")
    importer.add_argument("--out", type=Path, required=True)
    importer.add_argument("--force", action="store_true", help="overwrite --out")
    importer.set_defaults(run=run_import)

    stats = actions.add_parser("stats", help="count records per domain and source")
    stats.add_argument("inputs", nargs="+", type=Path)
    stats.set_defaults(run=run_stats)


def run_generate(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.force:
        raise SpecError(f"{args.out} exists; pass --force to overwrite it")
    if args.samples < 0 or (args.no_greedy and args.samples == 0 and not args.reference):
        raise SpecError("nothing to generate: keep the greedy completion or ask for --samples >= 1")
    prompts = [spec for source in args.prompts for spec in load_prompts(source)]
    loaded = load_model(args.model)
    records = generate_traffic(loaded, prompts, greedy=not args.no_greedy, samples=args.samples,
                               temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                               batch_size=args.batch_size, seed=args.seed, reference=args.reference)
    count = write_traffic(records, args.out, force=args.force)
    print(f"wrote {count} records for {len(prompts)} prompts to {args.out}")
    return 0


def run_import(args: argparse.Namespace) -> int:
    importer = import_sglang_log if args.format == "sglang" else import_openai_chat
    records, problem_count, ignored = [], 0, 0
    for path in args.inputs:
        good, problems, skipped = importer(path, domain=args.domain)
        for problem in problems:
            sys.stderr.write(f"{path}: {problem}\n")
        records += good
        problem_count += len(problems)
        ignored += skipped
    count = write_traffic(records, args.out, force=args.force)
    print(f"imported {count} records into {args.out}"
          + (f"; ignored {ignored} events that carry no completion (request.received)" if ignored else ""))
    if problem_count:
        sys.stderr.write(f"error: {problem_count} malformed line(s) reported above were not imported\n")
        return 1
    return 0


def run_stats(args: argparse.Namespace) -> int:
    for path in args.inputs:
        records, problems = read_traffic(path)
        domains = Counter(record.domain for record in records)
        sources = Counter(record.source.split(" temperature")[0] for record in records)
        print(f"{path}: {len(records)} records, {len(problems)} malformed; domains {dict(domains)}; "
              f"sources {dict(sources)}")
        for problem in problems:
            sys.stderr.write(f"{path}: {problem}\n")
    return 0
