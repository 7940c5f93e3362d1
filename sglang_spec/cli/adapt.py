"""``sglang-spec adapt``: keep training the head a live SGLang tree server drafts with, on the traffic it serves,
and swap each better head into it without a restart (``train/adapt.py``)."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

from sglang_spec.catalog import resolve_model_path
from sglang_spec.cli.parser import MAX_BATCH_SIZE, MAX_STEPS, integer, number, path_arg, text_arg
from sglang_spec.errors import SpecError
from sglang_spec.models.loading import load_tokenizer
from sglang_spec.models.target_shell import read_model_config
from sglang_spec.train.adapt import STATE_FILE, AdaptJob, AdaptSettings, Adapter
from sglang_spec.train.server_capture import check_url, post_json

# the options that are AdaptSettings fields: (type, help)
_SETTINGS = {
    "window": (integer(1), "captured sequences each round trains on (the newest; older shards are deleted)"),
    "train_every": (integer(1), "new captured sequences between training rounds"),
    "steps": (integer(1, MAX_STEPS), "optimizer steps a round"),
    "batch_size": (integer(1, MAX_BATCH_SIZE), "sequences per step"),
    "seq_len": (integer(3), "tokens per sequence (the end kept: the answer and the end of its prompt)"),
    "unroll": (integer(1, 16), "drafting steps trained"),
    "lr": (number(0, 1, low_open=True), "peak learning rate of a round, in (0, 1]"),
    "holdout": (number(0, 1, high_open=True), "share of the window a round holds out of training, on which the "
                "candidate and the head it was trained from are scored before a swap (0: no screen), in [0, 1)"),
    "probation_steps": (integer(1), "verify steps a swapped-in head serves before the guard's verdict"),
    "margin": (number(0, 1, high_open=True), "a head on probation whose accept length falls below (1 - margin) "
               "times the previous head's is rolled back, in [0, 1)"),
    "capture_batch": (integer(1, MAX_BATCH_SIZE), "served requests replayed for their hidden states per request"),
    "min_free_mb": (integer(0), "free disk (MiB) under --work below which capture pauses"),
    "train_processes": (integer(1, 64), "trainer processes (torchrun, FSDP2) a round"),
    "train_threads": (integer(1, 1024), "threads each trainer process uses"),
    "train_nice": (integer(0, 19), "the trainer's niceness (0: as the loop)"),
    "poll_seconds": (number(0.01, 3600), "how often the loop looks for new traffic when idle"),
}


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    defaults = AdaptSettings()
    parser = subcommands.add_parser(
        "adapt",
        help="keep training a live tree server's head on its own traffic and swap better heads in (no restart)",
        description="Beside a running SGLang tree server launched with --speculative-tree-traffic-log LOG "
        "--enable-return-hidden-states --disable-radix-cache --enable-metrics: captures the requests it serves "
        "(one prefill each for the target's hidden states) into a rolling window, trains a head from the served "
        "one on it every --train-every new sequences, swaps the new head into the server through SGLang's "
        "in-place weight update of the draft runner, and rolls it back when its accept length on probation falls "
        "below the previous head's by --margin. Runs until --verdicts or --duration, or Ctrl-C; the same command "
        "resumes from --work.",
    )
    parser.add_argument("--from-server", required=True, type=text_arg, help="the server's URL")
    parser.add_argument("--traffic-log", required=True, type=path_arg,
                        help="the file the server logs its traffic to (its --speculative-tree-traffic-log)")
    parser.add_argument("--model", required=True, type=text_arg,
                        help="smollm2, or the local folder of the served model (config and tokenizer are read)")
    parser.add_argument("--head", required=True, type=path_arg,
                        help="the head file the server launched with (exported as its draft)")
    parser.add_argument("--work", required=True, type=path_arg,
                        help="folder for the capture window, the heads, the state and events.jsonl")
    parser.add_argument("--offer", type=path_arg, default=None,
                        help="a head file to swap in under probation before the first training round")
    parser.add_argument("--verdicts", type=integer(1), default=None,
                        help="stop after this many probation verdicts (kept or rolled back)")
    parser.add_argument("--duration", type=number(0, 10**7, low_open=True), default=None,
                        help="stop after this many seconds")
    for name, (kind, help_text) in _SETTINGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(defaults, name),
                            help=f"{help_text} (default {getattr(defaults, name)})")
    parser.add_argument("--bf16", action="store_true",
                        help="train each round with bfloat16 autocast (float32 master weights): faster on "
                        "bf16-capable CPUs and GPUs")
    parser.add_argument("--force", action="store_true", help="delete what --work holds and start over")
    parser.add_argument("--json", action="store_true", help="print the final state as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    url = check_url(args.from_server)
    settings = AdaptSettings(**{f.name: getattr(args, f.name) for f in fields(AdaptSettings)})
    if not args.head.is_file():
        raise SpecError(f"--head {args.head} does not exist")
    if args.offer is not None and not args.offer.is_file():
        raise SpecError(f"--offer {args.offer} does not exist")
    if args.work.exists() and not args.work.is_dir():
        raise SpecError(f"--work {args.work} is a file; give a folder")
    if args.work.is_dir() and any(args.work.iterdir()) and not (args.work / STATE_FILE).exists() and not args.force:
        raise SpecError(f"--work {args.work} holds other files; give an empty or new folder")
    if args.force and args.work.is_dir():
        shutil.rmtree(args.work)
    label, folder = resolve_model_path(args.model, progress=not args.json)
    config = read_model_config(folder)
    if config.get("model_type") != "llama":
        raise SpecError(f"adapt swaps Llama-family heads (SGLang's draft model of the plugin); {label} is "
                        f"{config.get('model_type')}")
    info = post_json(url, "/server_info", None, timeout=30)
    ranks = int(info.get("tp_size") or 1) if isinstance(info, dict) else 1
    if isinstance(info, dict) and info.get("speculative_algorithm") in (None, "None"):
        raise SpecError(f"{url} serves without speculation: there is no draft head to adapt")
    tokenizer, _, _ = load_tokenizer(folder, SimpleNamespace(eos_token_id=config.get("eos_token_id")))
    job = AdaptJob(url=url, log=args.traffic_log, model=args.model, model_type=str(config["model_type"]),
                   hidden_size=int(config["hidden_size"]), vocab_size=int(config["vocab_size"]),
                   encode=lambda text: list(tokenizer.encode(text)), head=Path(args.head), work=args.work,
                   settings=settings, offer=args.offer, max_verdicts=args.verdicts, max_seconds=args.duration,
                   ranks=ranks)
    say = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    state = Adapter(job, say).run()
    if args.json:
        print(json.dumps({"work": str(args.work), **state.to_json()}))
    else:
        print(f"served head {state.served} (last good {state.last_good}); {state.requests_seen} requests seen, "
              f"{state.captured} captured, {state.rounds} training rounds, {state.verdicts} verdicts")
    return 0
