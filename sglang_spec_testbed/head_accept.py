"""Accept length of MTP heads served by SGLang's real server on this CPU, before and after training, in one
command:

    python -m sglang_spec_testbed.head_accept --model tiny-deepseek --before builtin \\
        --after head.safetensors --prompts heldout.jsonl

Each head is exported as the draft SGLang loads for NEXTN (``export.py``: DeepSeek's ``model.layers.{L}.*`` or
the Llama draft folder), served in turn (one server at a time) with the same tree, and asked for greedy answers
to the same prompts; the accept length is the mean over verify steps of accepted drafts + 1, from SGLang's
per-request ``spec_correct_drafts_histogram``. ``builtin`` is the model's own draft (its checkpoint's MTP layer,
or the head shipped with it). Any other option goes to ``launch_server`` (default tree: a chain of 3).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from sglang_spec.errors import SpecError, exit_status
from sglang_spec.models.loading import load_tokenizer
from sglang_spec.models.target_shell import read_model_config
from sglang_spec_testbed.server import CpuModel, SGLangServer, cpu_launch_args, free_port, prepare_model
from sglang_spec.sglang_plugin.export import DraftExport, export_deepseek_draft, export_llama_draft
from sglang_spec.train.prompts import PROMPT_SETS, load_prompts
from sglang_spec.train.server_capture import encode_prompt

DEFAULT_TREE = ("--speculative-tree-policy", "chain", "--speculative-tree-budget", "3",
                "--speculative-tree-depth", "3")
BUILTIN = "builtin"


@dataclass(frozen=True)
class ServedAcceptance:
    head: str  # the head file, or "builtin"
    accept_length: float  # mean over verify steps of accepted drafts + 1
    verify_steps: int
    output_ids: list[list[int]]  # the greedy answers (equal for every head: speculation is lossless)


def accept_length(answers: Sequence[dict]) -> tuple[float, int]:
    """(mean accept length, verify steps) from SGLang answers: entry k of each request's
    ``spec_correct_drafts_histogram`` counts its verify steps that accepted k drafts."""
    steps = accepted = 0
    for answer in answers:
        histogram = answer.get("meta_info", {}).get("spec_correct_drafts_histogram") or []
        steps += sum(int(count) for count in histogram)
        accepted += sum((drafts + 1) * int(count) for drafts, count in enumerate(histogram))
    if steps == 0:
        raise SpecError("the server reported no verify steps (is speculation on?)")
    return accepted / steps, steps


def export_head(model: CpuModel, head: str, out_dir: Path) -> CpuModel:
    """``model`` drafting with ``head`` (a head file exported into ``out_dir``), or as it is for ``builtin``."""
    if head == BUILTIN:
        return model
    if not Path(head).is_file():
        raise SpecError(f"head {head} does not exist (give a .safetensors head file or {BUILTIN!r})")
    model_type = read_model_config(model.target_dir).get("model_type")
    exporter = export_deepseek_draft if model_type == "deepseek_v3" else export_llama_draft
    export: DraftExport = exporter(head, model.target_dir, out_dir)
    return replace(model, draft_args=tuple(export.server_args()))


def serve_and_measure(model: CpuModel, head: str, prompts: list[list[int]], max_new_tokens: int,
                      extra: Sequence[str], log_path: Path, work: Path) -> ServedAcceptance:
    """One server drafting with ``head``: greedy answers to ``prompts`` and their accept length."""
    served = export_head(model, head, work)
    port = free_port()
    with SGLangServer(cpu_launch_args(served, port, extra=extra), port, log_path) as server:
        answers = server.generate(prompts, {"temperature": 0, "max_new_tokens": max_new_tokens})
    length, steps = accept_length(answers)
    return ServedAcceptance(head, length, steps, [answer["output_ids"] for answer in answers])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_spec_testbed.head_accept",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="Any other option is passed to python -m sglang.launch_server.")
    parser.add_argument("--model", choices=("smollm2", "tiny-deepseek"), required=True)
    parser.add_argument("--before", default=BUILTIN, help=f"the head it started from (default {BUILTIN})")
    parser.add_argument("--after", required=True, help="the trained head (.safetensors)")
    parser.add_argument("--prompts", action="append", required=True,
                        help=f"held-out prompts: {PROMPT_SETS}; repeatable")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--logs", type=Path, default=None, help="folder for the servers' logs (default: temporary)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args, extra = parser.parse_known_args(argv)
    return exit_status(lambda: _run(args, list(extra) or list(DEFAULT_TREE)))


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    model = prepare_model(args.model, progress=not args.json)
    config = read_model_config(model.target_dir)
    eos = argparse.Namespace(eos_token_id=config.get("eos_token_id"))  # the config field load_tokenizer reads
    tokenizer, _, chat = load_tokenizer(model.target_dir, eos)
    prompts = [encode_prompt(tokenizer, chat, spec) for name in args.prompts for spec in load_prompts(name)]
    with tempfile.TemporaryDirectory(prefix="head-accept-") as temporary:
        work = Path(temporary)
        logs = args.logs or work
        results = [serve_and_measure(model, head, prompts, args.max_new_tokens, extra, logs / f"{name}.log",
                                     work / f"{name}-draft")
                   for name, head in (("before", args.before), ("after", args.after))]
    before, after = results
    if before.output_ids != after.output_ids:  # lossless in exact arithmetic; a float near-tie can flip a token
        print("note: the two servers' greedy answers differ (a near-tie in the verify arithmetic, or a bug)",
              file=sys.stderr)
    report = {"model": args.model, "prompts": len(prompts), "before": before.__dict__ | {"output_ids": None},
              "after": after.__dict__ | {"output_ids": None}, "gain": after.accept_length / before.accept_length - 1}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.model}, {len(prompts)} prompts, greedy, {' '.join(extra)}")
        print(f"accept length before ({before.head}): {before.accept_length:.3f} over {before.verify_steps} verify "
              f"steps")
        print(f"accept length after  ({after.head}): {after.accept_length:.3f} over {after.verify_steps} verify "
              f"steps ({report['gain']:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
