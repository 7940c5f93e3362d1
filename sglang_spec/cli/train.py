"""``sglang-spec train``: fit an MTP head to a target on traffic, or on a capture from a server, by
self-distillation. Under ``torchrun`` the head trains on every rank, sharded by FSDP2 (``train/distributed.py``):

    torchrun --nproc-per-node 2 -m sglang_spec.cli train --capture DIR --model tiny-deepseek --out head.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sglang_spec.catalog import load_model, model_label, resolve_model_path
from sglang_spec.cli.parser import MAX_BATCH_SIZE, MAX_STEPS, integer, number, path_arg, seed, text_arg
from sglang_spec.errors import SpecError
from sglang_spec.models.loading import LoadedModel, load_head_for
from sglang_spec.models.target_shell import load_target_shell
from sglang_spec.mtp.head import FEEDBACK_MODES
from sglang_spec.train.capture import read_manifest
from sglang_spec.train.distributed import World, exit_rank, join_world, leave_world, training_device
from sglang_spec.train.traffic import TrafficRecord, check_traffic_model, read_traffic_strict
from sglang_spec.train.trainer import (TrainConfig, check_train_paths, resume_config, state_path_for, train_head,
                                       train_head_from_capture)
from sglang_spec.tree.token_tree import MAX_DEPTH


# the options that are TrainConfig fields; on --resume only the ones given on the command line replace the saved
# run's settings, so their parser default is None and TrainConfig's default applies otherwise
_SETTINGS = {
    "steps": (integer(1, MAX_STEPS), "optimizer steps"),
    "batch_size": (integer(1, MAX_BATCH_SIZE), "sequences per step"),
    "seq_len": (integer(3), "tokens per sequence (at most the model's context)"),
    "unroll": (integer(1, MAX_DEPTH), "recursive drafting steps trained"),
    "lr": (number(0, 1, low_open=True), "peak learning rate, in (0, 1]"),
    "draft_vocab": (integer(0), "draft vocabulary size; 0 = full vocabulary"),
    "top_k_targets": (integer(1), "teacher probabilities kept per position (at most the draft vocabulary)"),
    "checkpoint_every": (integer(1), "steps between checkpoints"),
    "eval_fraction": (number(0, 1, high_open=True), "share of prompts held out for evaluation, in [0, 1)"),
    "seed": (seed, "random seed"),
}


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    defaults = TrainConfig()
    parser = subcommands.add_parser(
        "train",
        help="train an MTP head on traffic (self-distillation, unrolled recursive drafting)",
        description="Matches the target's own next-next-token distribution on the traffic, with the recursive "
        "drafting unrolled so deeper tree levels learn too. The head drafts over the most frequent tokens of the "
        "traffic (--draft-vocab); verification always uses the full vocabulary, so output is unchanged. "
        "With --resume the saved run's settings apply; the ones given on the command line replace them (each "
        "change is reported) except those that fix the data (--seq-len, --draft-vocab, --top-k-targets, "
        "--eval-fraction).",
    )
    parser.add_argument("--model", type=text_arg, default=None,
                        help="smollm2, tiny-deepseek, or a local model folder (with --capture: default the "
                        "captured model; only its config, tokenizer, embedding and output head are loaded)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--traffic", type=path_arg, action="append",
                        help="traffic JSONL; repeatable (the target is loaded for a teacher pass)")
    source.add_argument("--capture", type=path_arg, default=None,
                        help="a dataset folder from `sglang-spec capture` (the target is not loaded)")
    parser.add_argument("--domain", action="append", default=None, type=text_arg,
                        help="keep only these domains; repeatable")
    parser.add_argument("--out", type=path_arg, required=True, help="head .safetensors to write")
    parser.add_argument("--init", default=None, type=text_arg,
                        help="start from this head (.safetensors) or DeepSeek checkpoint")
    for name, (kind, help_text) in _SETTINGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                            help=f"{help_text} (default {getattr(defaults, name)})")
    parser.add_argument("--bf16", action="store_true", default=None,
                        help="train with bfloat16 autocast (float32 master weights): faster on bf16-capable CPUs/GPUs")
    parser.add_argument("--feedback", choices=list(FEEDBACK_MODES), default=None,
                        help=f"the state a drafting step feeds back: the block's output (pre_norm, vLLM) or its "
                        f"normed output (post_norm: SGLang's DeepSeek NextN; train with it to serve the head "
                        f"there); default {defaults.feedback}")
    parser.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help=f"dtype of the written head (bfloat16 halves it; loading casts back; default "
                        f"{defaults.save_dtype})")
    parser.add_argument("--keep-draft-vocab", action="store_true",
                        help="with --capture and --init: draft over the --init head's vocabulary, not the capture's "
                        "most frequent tokens (a head swapped into a running server keeps its token map; "
                        "`sglang-spec adapt` trains so)")
    parser.add_argument("--teacher-store", type=path_arg, default=None, metavar="DIR",
                        help="with --capture: keep each sequence's soft targets in DIR, so a later run over the same "
                             "sequences (a rolling window) reads them instead of recomputing")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--force", action="store_true", help="overwrite --out and its training state")
    parser.add_argument("--allow-model-mismatch", action="store_true",
                        help="train on traffic (or from an --init head) made by another model")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    world = join_world()
    try:
        code = _run(args, world)
        world.barrier()  # every rank done
    except BaseException:
        leave_world(world)
        raise
    if world.sharded:
        exit_rank(code)  # without the group's racy teardown
    return code


def _run(args: argparse.Namespace, world: World) -> int:
    given = {name: getattr(args, name) for name in _SETTINGS if getattr(args, name) is not None}
    if args.save_dtype is not None:
        given["save_dtype"] = args.save_dtype
    if args.feedback is not None:
        given["feedback"] = args.feedback
    if args.bf16:
        given["autocast_bf16"] = True
    if args.batch_size is not None and args.batch_size < world.size:
        raise SpecError(f"--batch-size {args.batch_size} is smaller than the {world.size} processes; give each "
                        f"at least one sequence")
    # everything that can be checked without the model first: a bad --out fails now, not after the teacher pass
    if args.teacher_store is not None and args.capture is None:
        raise SpecError("--teacher-store keeps soft targets of captured sequences; use it with --capture, or drop it")
    if args.keep_draft_vocab and (args.capture is None or args.init is None):
        raise SpecError("--keep-draft-vocab keeps the --init head's vocabulary when training from --capture; give "
                        "both, or drop it")
    check_train_paths(args.out, args.resume, args.force)
    if args.resume:
        config, notes = resume_config(state_path_for(args.out), given)
        for note in notes if world.is_main else ():
            print(note, file=sys.stderr)
    else:
        config = TrainConfig(**given)
    progress = not args.json and world.is_main
    records: list[TrafficRecord] = []
    if args.capture is not None:
        loaded, metadata = _from_capture(args, progress)
    else:
        if args.model is None:
            raise SpecError("--model is required with --traffic")
        records = read_traffic_strict(args.traffic)
        if args.domain:
            records = [record for record in records if record.domain in args.domain]
            if not records:
                raise SpecError(f"no traffic records with domain {', '.join(args.domain)}")
        _check_init(args)
        loaded = load_model(args.model, progress=progress)
        warning = check_traffic_model(records, loaded.name, args.allow_model_mismatch)
        if warning and world.is_main:
            print(warning, file=sys.stderr)
        metadata = {"model": loaded.name, "traffic": [str(p) for p in args.traffic], "domains": args.domain,
                    "init": args.init}
    init = None
    if args.init is not None:
        init = load_head_for(loaded, args.init, feedback=config.feedback,
                             allow_model_mismatch=args.allow_model_mismatch)
        if args.feedback is not None:  # how the head drafts, not a weight: --feedback replaces the head file's
            init.feedback = args.feedback
    common = dict(init=init, resume=args.resume, force=args.force, progress=progress, metadata=metadata,
                  world=world)
    if args.capture is not None:
        summary = train_head_from_capture(loaded, args.capture, config, args.out,
                                          keep_draft_vocab=args.keep_draft_vocab, teacher_store=args.teacher_store,
                                          **common)
    else:
        summary = train_head(loaded, records, config, args.out, **common)
    if not world.is_main:
        return 0
    report = {"out": str(args.out), "world_size": world.size, **summary.__dict__}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"wrote {args.out}: {summary.steps} steps in {summary.seconds / 60:.1f} min on "
              f"{summary.train_sequences} sequences ({summary.train_tokens} tokens)"
              + (f", {world.size} processes" if world.size > 1 else ""))
        print(f"draft vocabulary {summary.draft_vocab_size} tokens, covering {summary.draft_vocab_coverage:.1%} of "
              f"completion tokens")
        depths = ", ".join(f"d{i + 1} {value:.3f}" for i, value in enumerate(summary.eval_top1))
        before = ", ".join(f"d{i + 1} {value:.3f}" for i, value in enumerate(summary.init_eval_top1))
        print(f"held-out top-1 agreement per drafting depth, on the answers: {depths or 'no held-out sequences'}"
              + (f" (the --init head: {before})" if before else ""))
    return 0


def _check_init(args: argparse.Namespace) -> None:
    if args.init is not None and not Path(args.init).exists():
        raise SpecError(f"--init {args.init} does not exist")


def _from_capture(args: argparse.Namespace, progress: bool) -> tuple[LoadedModel, dict[str, Any]]:
    """(target shell, metadata) for ``--capture``: the model the manifest names unless --model."""
    if args.domain:
        raise SpecError("--domain filters traffic; a capture is trained on as a whole")
    manifest = read_manifest(args.capture)
    model = args.model or manifest.source.get("model_path") or manifest.model
    _check_init(args)
    label = manifest.model if args.model is None else model_label(model)
    if label != manifest.model and not args.allow_model_mismatch:  # checked before the model is built
        raise SpecError(f"{args.capture} was captured from {manifest.model!r}, not {label!r}; pass "
                        f"--allow-model-mismatch to train on it anyway")
    _, folder = resolve_model_path(model, progress=progress)
    # a GPU when there is one (untested here: this project's CI has none), else the CPU
    loaded = load_target_shell(label, folder, device=training_device())
    metadata = {"model": label, "capture": str(args.capture), "captured_sequences": manifest.num_sequences,
                "init": args.init}
    return loaded, metadata
