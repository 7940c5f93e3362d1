"""``sglang-spec capture``: record a live SGLang server's answers and hidden states as a training dataset."""

from __future__ import annotations

import argparse
import json
import shutil
from types import SimpleNamespace

from sglang_spec.catalog import resolve_model_path
from sglang_spec.cli.parser import MAX_BATCH_SIZE, MAX_TEMPERATURE, integer, path_arg, seed, temperature, text_arg
from sglang_spec.errors import SpecError
from sglang_spec.files import check_output_path
from sglang_spec.models.loading import load_tokenizer
from sglang_spec.models.target_shell import read_model_config
from sglang_spec.train.capture import DTYPES, MANIFEST, CaptureManifest
from sglang_spec.train.prompts import PROMPT_SETS, load_prompts
from sglang_spec.train.server_capture import CaptureSettings, capture_from_server, check_url, encode_prompt


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    defaults = CaptureSettings()
    parser = subcommands.add_parser(
        "capture",
        help="record a live SGLang server's answers and final hidden states for training (no target loaded)",
        description="Sends the prompts to a running SGLang server (launched with --enable-return-hidden-states "
        "and --disable-radix-cache) and stores the token ids of each prompt and answer with the target's final "
        "hidden states in a folder of safetensors shards and a manifest. Each shard is written whole or not at "
        "all; running the same command again resumes, skipping the prompts already stored. Train from the "
        "folder with `sglang-spec train --capture DIR`.",
    )
    parser.add_argument("--from-server", required=True, type=text_arg,
                        help="the server's URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model", required=True, type=text_arg,
                        help="smollm2, tiny-deepseek, or the local folder of the served model (its config and "
                        "tokenizer are read; its weights are not)")
    parser.add_argument("--prompts", action="append", required=True, type=text_arg,
                        help=f"{PROMPT_SETS} (.jsonl / .txt); repeatable")
    parser.add_argument("--out", type=path_arg, required=True, help="dataset folder to write (or resume)")
    parser.add_argument("--max-new-tokens", type=integer(1), default=defaults.max_new_tokens,
                        help=f"answer tokens per prompt (default {defaults.max_new_tokens})")
    parser.add_argument("--temperature", type=temperature, default=defaults.temperature,
                        help=f"sampling temperature in [0, {MAX_TEMPERATURE:g}]; 0 = greedy (default)")
    parser.add_argument("--batch-size", type=integer(1, MAX_BATCH_SIZE), default=defaults.batch_size,
                        help=f"prompts per request (default {defaults.batch_size})")
    parser.add_argument("--shard-size", type=integer(1), default=defaults.shard_size,
                        help=f"sequences per shard (default {defaults.shard_size}); an interruption loses at "
                        "most one shard's worth")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                        help="dtype of the stored hidden states (default float16, as the trainer's teacher cache)")
    parser.add_argument("--seed", type=seed, default=defaults.seed, help="sampling seed (temperature > 0)")
    parser.add_argument("--force", action="store_true", help="delete what --out holds and start over")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    url = check_url(args.from_server)
    if args.out.exists() and not args.out.is_dir():
        raise SpecError(f"--out {args.out} is a file; give a folder for the dataset")
    if args.out.is_dir() and any(args.out.iterdir()) and not (args.out / MANIFEST).exists():
        raise SpecError(f"--out {args.out} is a folder holding other files; give an empty or new folder")
    check_output_path(args.out / MANIFEST, force=True)
    prompts = [spec for name in args.prompts for spec in load_prompts(name)]
    seen: set[str] = set()
    for spec in prompts:
        if spec.id in seen:
            raise SpecError(f"prompt id {spec.id!r} appears twice; each prompt is stored under its id")
        seen.add(spec.id)
    label, folder = resolve_model_path(args.model, progress=not args.json)
    config = read_model_config(folder)
    tokenizer, _, chat = load_tokenizer(folder, SimpleNamespace(eos_token_id=config.get("eos_token_id")))
    encoded = [encode_prompt(tokenizer, chat, spec) for spec in prompts]
    empty = next((spec.id for spec, tokens in zip(prompts, encoded) if not tokens), None)
    if empty is not None:
        raise SpecError(f"prompt {empty!r} encodes to no tokens")
    context = config.get("max_position_embeddings")
    if isinstance(context, int):
        longest = max(range(len(encoded)), key=lambda index: len(encoded[index]))
        if len(encoded[longest]) + args.max_new_tokens > context:
            raise SpecError(f"prompt {prompts[longest].id!r} ({len(encoded[longest])} tokens) plus --max-new-tokens "
                            f"{args.max_new_tokens} exceeds {label}'s context of {context} tokens")
    if args.force and args.out.is_dir():
        shutil.rmtree(args.out)
    manifest = CaptureManifest(label, str(config.get("model_type")), config["hidden_size"], config["vocab_size"],
                               args.dtype, source={"model_path": str(folder.resolve())})
    settings = CaptureSettings(args.max_new_tokens, args.temperature, args.batch_size, args.shard_size, args.seed)
    summary = capture_from_server(url, prompts, encoded, manifest, args.out, settings, progress=not args.json)
    if args.json:
        print(json.dumps({"out": str(args.out), **summary.__dict__}))
    else:
        print(f"captured {summary.captured} sequences ({summary.tokens} tokens) into {args.out}"
              + (f"; {summary.skipped} prompts were already there" if summary.skipped else "")
              + f"; the dataset holds {summary.sequences} sequences in {summary.shards} shards")
    return 0
