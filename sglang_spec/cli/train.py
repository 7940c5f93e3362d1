"""``sglang-spec train``: fit an MTP head to a target on traffic by self-distillation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sglang_spec.catalog import load_model
from sglang_spec.errors import SpecError
from sglang_spec.models.registry import load_head_for
from sglang_spec.train.traffic import read_traffic_strict
from sglang_spec.train.trainer import TrainConfig, train_head


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    defaults = TrainConfig()
    parser = subcommands.add_parser(
        "train",
        help="train an MTP head on traffic (self-distillation, unrolled recursive drafting)",
        description="Matches the target's own next-next-token distribution on the traffic, with the recursive "
        "drafting unrolled so deeper tree levels learn too. The head drafts over the most frequent tokens of the "
        "traffic (--draft-vocab); verification always uses the full vocabulary, so output is unchanged.",
    )
    parser.add_argument("--model", required=True, help="smollm2, tiny-deepseek, or a local model folder")
    parser.add_argument("--traffic", type=Path, action="append", required=True, help="traffic JSONL; repeatable")
    parser.add_argument("--domain", action="append", default=None, help="keep only these domains; repeatable")
    parser.add_argument("--out", type=Path, required=True, help="head .safetensors to write")
    parser.add_argument("--init", default=None, help="start from this head (.safetensors) or DeepSeek checkpoint")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--unroll", type=int, default=defaults.unroll, help="recursive drafting steps trained")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab, help="0 = full vocabulary")
    parser.add_argument("--top-k-targets", type=int, default=defaults.top_k_targets,
                        help="teacher probabilities kept per position")
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    parser.add_argument("--eval-fraction", type=float, default=defaults.eval_fraction)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--bf16", action="store_true",
                        help="train with bfloat16 autocast (float32 master weights): faster on bf16-capable CPUs/GPUs")
    parser.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"], default=defaults.save_dtype,
                        help="dtype of the written head (bfloat16 halves it; loading casts back)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--force", action="store_true", help="overwrite --out and its training state")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, unroll=args.unroll, lr=args.lr,
        draft_vocab=args.draft_vocab, top_k_targets=args.top_k_targets, checkpoint_every=args.checkpoint_every,
        eval_fraction=args.eval_fraction, seed=args.seed, save_dtype=args.save_dtype,
        autocast_bf16=args.bf16,
    )
    records = read_traffic_strict(args.traffic)
    if args.domain:
        records = [record for record in records if record.domain in args.domain]
        if not records:
            raise SpecError(f"no traffic records with domain {', '.join(args.domain)}")
    if args.init is not None and not Path(args.init).exists():
        raise SpecError(f"--init {args.init} does not exist")
    loaded = load_model(args.model, progress=not args.json)
    init = load_head_for(loaded, args.init) if args.init is not None else None
    summary = train_head(
        loaded, records, config, args.out, init=init, resume=args.resume, force=args.force, progress=not args.json,
        metadata={"model": loaded.name, "traffic": [str(p) for p in args.traffic], "domains": args.domain,
                  "init": args.init},
    )
    report = {"out": str(args.out), **summary.__dict__}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"wrote {args.out}: {summary.steps} steps in {summary.seconds / 60:.1f} min on "
              f"{summary.train_sequences} sequences ({summary.train_tokens} tokens)")
        print(f"draft vocabulary {summary.draft_vocab_size} tokens, covering {summary.draft_vocab_coverage:.1%} of "
              f"completion tokens")
        print("held-out top-1 agreement per drafting depth: "
              + ", ".join(f"d{i + 1} {value:.3f}" for i, value in enumerate(summary.eval_top1)))
    return 0
