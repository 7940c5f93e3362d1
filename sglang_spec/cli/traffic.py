"""``sglang-spec traffic``: build training traffic (generate with the target, or import a server's logs)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from sglang_spec.catalog import load_model
from sglang_spec.cli.parser import MAX_BATCH_SIZE, MAX_SAMPLES, MAX_TEMPERATURE, integer, path_arg, seed, text_arg
from sglang_spec.errors import SpecError
from sglang_spec.files import check_output_path
from sglang_spec.sampling import TEMPERATURE_FLOOR
from sglang_spec.train.generate_traffic import generate_traffic, prompt_tokens
from sglang_spec.train.prompts import PROMPT_SETS, PromptSpec, load_prompts
from sglang_spec.train.traffic import (
    PartialTraffic,
    TrafficRecord,
    import_openai_chat,
    import_sglang_log,
    read_traffic,
    write_traffic,
)


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser("traffic", help="generate or import traffic (JSONL, one request per line)")
    actions = parser.add_subparsers(dest="action", required=True, parser_class=type(parser))

    generate = actions.add_parser(
        "generate", help="run the target on prompt sets and record its own completions",
        description="Each finished record is appended to OUT.partial at once; the complete file is renamed to OUT "
        "at the end. An interrupted run keeps its records: the same command again resumes it, generating only "
        "what is missing (delete OUT.partial to start over).")
    generate.add_argument("--model", required=True, type=text_arg,
                          help="smollm2, tiny-deepseek, or a local model folder")
    generate.add_argument("--prompts", action="append", required=True, type=text_arg,
                          help=f"{PROMPT_SETS} (.jsonl / .txt); repeatable")
    generate.add_argument("--samples", type=integer(0, MAX_SAMPLES), default=1,
                          help=f"sampled completions per prompt (at most {MAX_SAMPLES})")
    generate.add_argument("--temperature", type=float, default=0.8,
                          help=f"temperature of the sampled completions, in [{TEMPERATURE_FLOOR:g}, "
                          f"{MAX_TEMPERATURE:g}] (the greedy one is recorded separately)")
    generate.add_argument("--no-greedy", action="store_true", help="skip the greedy completion")
    generate.add_argument("--reference", action="store_true",
                          help="also record each prompt's reference answer (teacher-forced text for training)")
    generate.add_argument("--max-new-tokens", type=integer(1), default=256,
                          help="at most the model's context minus the longest prompt")
    generate.add_argument("--batch-size", type=integer(1, MAX_BATCH_SIZE), default=32)
    generate.add_argument("--seed", type=seed, default=0)
    generate.add_argument("--out", type=path_arg, required=True)
    generate.add_argument("--force", action="store_true", help="overwrite --out")
    generate.set_defaults(run=run_generate)

    importer = actions.add_parser("import", help="convert an SGLang request log or OpenAI-style chat logs")
    importer.add_argument("inputs", nargs="+", type=path_arg)
    importer.add_argument("--format", choices=["sglang", "openai"], required=True)
    importer.add_argument("--domain", default="imported", type=text_arg, help="domain tag for every record")
    importer.add_argument("--out", type=path_arg, required=True)
    importer.add_argument("--force", action="store_true", help="overwrite --out")
    importer.set_defaults(run=run_import)

    stats = actions.add_parser("stats", help="count records per domain and source")
    stats.add_argument("inputs", nargs="+", type=path_arg)
    stats.set_defaults(run=run_stats)


def run_generate(args: argparse.Namespace) -> int:
    # everything that can be checked without the model first: a bad --out fails now, not after the generation
    check_output_path(args.out, args.force)
    if args.no_greedy and args.samples == 0 and not args.reference:
        raise SpecError("nothing to generate: keep the greedy completion or ask for --samples >= 1")
    if args.samples and not TEMPERATURE_FLOOR <= args.temperature <= MAX_TEMPERATURE:  # NaN too
        raise SpecError(f"sampled completions need --temperature in [{TEMPERATURE_FLOOR:g}, {MAX_TEMPERATURE:g}], "
                        f"got {args.temperature}; the greedy completion is recorded without --samples")
    prompts = [spec for source in args.prompts for spec in load_prompts(source)]
    partial = PartialTraffic(args.out)
    loaded = load_model(args.model)
    lengths = [len(prompt_tokens(loaded, spec)) for spec in prompts]
    loaded.check_lengths(lengths, args.max_new_tokens, names=[f"prompt {spec.id}" for spec in prompts])
    done = _resumable(partial, _planned(args, loaded.name, prompts), args.max_new_tokens)
    if done:
        print(f"resuming: {len(done)} records already in {partial.path}", file=sys.stderr)
    records = generate_traffic(loaded, prompts, greedy=not args.no_greedy, samples=args.samples,
                               temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                               batch_size=args.batch_size, seed=args.seed, reference=args.reference, skip=done)
    count = len(done)
    try:
        for record in records:
            partial.append(record)
            count += 1
    except KeyboardInterrupt:
        partial.close()
        print(f"interrupted: {count} records kept in {partial.path}; run the same command again to resume",
              file=sys.stderr)
        raise
    partial.finish()
    print(f"wrote {count} records for {len(prompts)} prompts to {args.out}")
    return 0


def _planned(args: argparse.Namespace, model: str, prompts: list[PromptSpec]) -> dict[str, str]:
    """record id -> the source this run writes for it."""
    runs = [("greedy", 0.0)] if not args.no_greedy else []
    runs += [(f"sample{i}", args.temperature) for i in range(args.samples)]
    planned = {f"{spec.id}/{tag}": f"generate {model} temperature={temperature}"
               for spec in prompts for tag, temperature in runs}
    if args.reference:
        planned.update({f"{spec.id}/reference": "reference" for spec in prompts if spec.reference})
    return planned


def _resumable(partial: PartialTraffic, planned: dict[str, str], max_new_tokens: int) -> set[str]:
    """The ids of an interrupted run's records, checked to be what this run would write."""
    for record in partial.done:
        wrong = _differs(record, planned, max_new_tokens)
        if wrong:
            raise SpecError(f"{partial.path} holds an interrupted run with other settings ({wrong} in record "
                            f"{record.id!r}); rerun that command to finish it, or delete the file to start over")
    return {record.id for record in partial.done}


def _differs(record: TrafficRecord, planned: dict[str, str], max_new_tokens: int) -> str | None:
    if record.id not in planned:
        return "another prompt set or sample count"
    if record.source != planned[record.id]:
        return f"source {record.source!r}, this run writes {planned[record.id]!r}"
    if record.source != "reference" and record.meta.get("max_new_tokens") != max_new_tokens:
        return f"--max-new-tokens {record.meta.get('max_new_tokens')}"
    return None


def run_import(args: argparse.Namespace) -> int:
    check_output_path(args.out, args.force)
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
