"""Per decode step time of SGLang's real server on this CPU: plain decoding against the plugin's trees, split into
the target's forward, the draft's forwards and everything else (the step's overhead).

    python bench/cpu_step_profile.py                       # plain, sequoia 15/4/4, specexec 15/4/4; 1 and 8 requests
    python bench/cpu_step_profile.py --configs plain,sequoia --concurrency 1 --max-new-tokens 16   # quicker
    python bench/cpu_step_profile.py --cprofile            # also cProfile's top functions per server (slower steps)
    python bench/cpu_step_profile.py --configs plain,plain-sync,auto --depth 8 --concurrency 16 # tree auto's cold steps

Each server (SmolLM2-135M + shipped head, through the CPU harness) is started with ``SGLANG_SPEC_CPU_PROFILE``
(``sglang_spec_testbed/profile.py``), warmed up with one short request, then decodes greedily ``--max-new-tokens``
tokens (ignore_eos) for 1 prompt and for N concurrent prompts (HumanEval 134 onwards, or with ``--workload`` one
of serving_sweep.py's held-out serving workloads). The scheduler records every
batch: its start, target and draft ``ModelRunner.forward`` time and the target forwards' modes (a step whose
target forward ran in DECODE mode is plain decoding's, or tree auto's cold step). ``plain-sync`` is plain decoding
with SGLang's overlap scheduler off (as the context policies run), ``auto`` is ``hybrid`` with
``--speculative-tree-auto`` (``auto-sync``: with the overlap scheduler off). A step's time is the scheduler loop's
period (the CPU server runs SGLang's overlap loop, which processes a step's result after launching the next);
overhead = step - target - draft. ms per token = mean step time / tokens decoded per step; the speedup is plain
decoding's ms per token over the row's (``plain``'s where it ran, else ``plain-sync``'s), and greedy outputs are
checked identical to that server's. A tree auto server also writes its planner's log (``SGLANG_SPEC_PLAN_LOG``, one
line a decode step): its decode steps are split into the plan's plain steps and tree steps, each with its own time,
parts and tokens (``split_by_kind``): what a tree step costs against a plain step on this machine, and how far
its verify alone would let it beat plain decoding were its drafting free (``bound_by_kind``). Writes JSON
(``--out``) and prints tables.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import sys
import time
from pathlib import Path

from harness import REPO, environment, markdown_table

from sglang_spec.cli.parser import OneLineErrorParser, comma_list, integer, one_of
from sglang_spec.errors import exit_status
from sglang_spec.files import check_output_path, write_text_atomic
from sglang_spec.sglang_plugin.step_planner import PLAN_LOG_ENV

CONFIGS = ("plain", "plain-sync", "sequoia", "specexec", "hybrid", "auto", "auto-sync")
DEFAULT_CONFIGS = ("plain", "sequoia", "specexec")
PLAIN_CONFIGS = ("plain", "plain-sync")
CPU_RUNNING_CAP = 8  # the CPU server's default --max-running-requests
HELD_OUT_FIRST = 134  # HumanEval 134 onwards: never in the shipped head's traffic


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=comma_list(one_of(CONFIGS, "server")), default=",".join(DEFAULT_CONFIGS),
                        help=f"servers to run, among {', '.join(CONFIGS)}")
    parser.add_argument("--budget", type=integer(2, 64), default=15)
    parser.add_argument("--depth", type=integer(1, 8), default=4)
    parser.add_argument("--topk", type=integer(1, 8), default=4)
    parser.add_argument("--mtp-levels", type=integer(1, 7), default=None,
                        help="hybrid / auto: head levels below the root's children (the server's default 2)")
    parser.add_argument("--concurrency", type=comma_list(integer(1, 16)), default="1,8",
                        help="concurrent requests per workload (above 8 the server's running cap is raised to it)")
    parser.add_argument("--max-new-tokens", type=integer(2, 1024), default=48)
    parser.add_argument("--workload", choices=("heldout", "code", "extraction", "chat"), default="heldout",
                        help="heldout: HumanEval 134 onwards as chat requests; code / extraction / chat: "
                             "serving_sweep.py's held-out serving workloads (extraction: ~1,000-token prompts)")
    parser.add_argument("--cprofile", action="store_true",
                        help="run the decode steps under cProfile and print each server's top functions")
    parser.add_argument("--top", type=integer(1, 200), default=25, help="functions printed per server (--cprofile)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "cpu_step_profile" / "steps.json")
    return parser.parse_args(argv)


def tree_args(config: str, args: argparse.Namespace, profile: Path) -> list[str]:
    running = max(args.concurrency)
    cap = ["--max-running-requests", str(running)] if running > CPU_RUNNING_CAP else []
    if config in PLAIN_CONFIGS:
        return cap + (["--disable-overlap-schedule"] if config == "plain-sync" else [])
    policy = "hybrid" if config.startswith("auto") else config
    tree = ["--speculative-tree-policy", policy, "--speculative-tree-budget", str(args.budget),
            "--speculative-tree-depth", str(args.depth), "--speculative-tree-topk", str(args.topk)]
    tree += ["--speculative-acceptance-profile", str(profile)] if policy in ("sequoia", "hybrid") else []
    if policy == "hybrid" and args.mtp_levels is not None:
        tree += ["--speculative-tree-mtp-levels", str(min(args.mtp_levels, args.depth - 1))]
    auto = ["--speculative-tree-auto"] if config.startswith("auto") else []
    return cap + tree + auto + (["--disable-overlap-schedule"] if config == "auto-sync" else [])


def read_steps(path: Path, after: int, timeout: float = 30.0) -> list[dict]:
    """The steps the scheduler wrote past line ``after``, once it has written them (it does when it goes idle,
    which may be just after the answer arrives)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) > after:
            time.sleep(0.5)  # the flush is one write; a second look makes sure it is complete
            again = path.read_text().splitlines()
            if len(again) == len(lines):
                return [json.loads(line) for line in lines[after:]]
        time.sleep(0.2)
    raise TimeoutError(f"the scheduler wrote no decode steps to {path} within {timeout:.0f} s")


def decode_periods(batches: list[dict]) -> list[tuple[dict, float | None]]:
    """Each decode step of ``batches`` (scheduler records, in order) with its period: its ``run_batch`` start to the
    next batch's (None for the burst's last batch, which has no next)."""
    following = [batch["start"] for batch in batches[1:]] + [None]
    return [(batch, None if start is None else start - batch["start"])
            for batch, start in zip(batches, following) if batch["mode"] == "DECODE"]


def summarise(config: str, concurrency: int, batches: list[dict], answers: list[dict]) -> dict:
    """One row: means per decode step (ms) and ms per decoded token. A step's time is the scheduler loop's period
    (its ``run_batch`` start to the next batch's), which the burst's last step lacks; the first token of each
    request comes from its prefill, so the decode steps produced the rest."""
    periods = [(batch, period) for batch, period in decode_periods(batches) if period is not None]
    count = sum(batch["mode"] == "DECODE" for batch in batches)
    decoded = sum(answer["meta_info"]["completion_tokens"] - 1 for answer in answers)
    timed = len(periods)
    step = sum(period for _, period in periods) / timed
    target = sum(batch["target_s"] for batch, _ in periods) / timed
    draft = sum(batch["draft_s"] for batch, _ in periods) / timed
    return {
        "config": config, "concurrency": concurrency, "steps": count, "timed_steps": timed,
        "other_batches": sorted(batch["mode"] for batch in batches if batch["mode"] != "DECODE"),
        "mean_batch": sum(batch["batch"] for batch, _ in periods) / timed,
        "tokens_per_step": decoded / count,
        "decode_mode_steps": sum(batch.get("target_modes") == ["DECODE"] for batch, _ in periods),
        "step_ms": 1e3 * step, "target_ms": 1e3 * target, "draft_ms": 1e3 * draft,
        "overhead_ms": 1e3 * (step - target - draft),
        "ms_per_token": 1e3 * step * count / decoded,
    }


def split_by_kind(batches: list[dict], plans: list[dict]) -> dict[str, dict]:
    """The decode steps of ``batches`` (scheduler records, in order) beside the planner's log of the same steps
    (``plans``, one line a decode step, in order), split by the plan's kind: ``plain`` (1 verify token a request)
    and ``tree``. Per kind, over its timed steps (``decode_periods``, as ``summarise`` times them): their count,
    mean ms per step and its target / draft / other parts, tokens committed and tokens verified per step, tokens
    per second. Empty where the two do not pair up step for step (a decode step the planner did not log)."""
    steps = decode_periods(batches)
    if len(steps) != len(plans) or any(batch["batch"] != plan["batch"] for (batch, _), plan in zip(steps, plans)):
        return {}
    kinds: dict[str, list[tuple[dict, float, dict]]] = {}
    for (batch, period), plan in zip(steps, plans):
        if period is not None:
            kinds.setdefault("plain" if plan["tokens"] == 1 else "tree", []).append((batch, period, plan))
    split = {}
    for name, timed in sorted(kinds.items()):
        seconds = sum(period for _, period, _ in timed)
        target = sum(batch["target_s"] for batch, _, _ in timed)
        draft = sum(batch["draft_s"] for batch, _, _ in timed)
        committed = sum(sum(plan["committed"]) for _, _, plan in timed)
        count = len(timed)
        split[name] = {"steps": count, "step_ms": 1e3 * seconds / count, "target_ms": 1e3 * target / count,
                       "draft_ms": 1e3 * draft / count, "overhead_ms": 1e3 * (seconds - target - draft) / count,
                       "tokens_per_step": committed / count,
                       "verify_tokens_per_step": sum(sum(plan["verify_tokens"]) for _, _, plan in timed) / count,
                       "tokens_per_second": committed / seconds}
    return split


def read_plans(path: Path, after: int) -> list[dict]:
    """The planner's log lines past line ``after`` (none where the server writes no log)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines[after:]]


def top_functions(pstats_path: Path, count: int) -> list[dict]:
    """cProfile's most expensive functions by own time, with their cumulative time."""
    stats = pstats.Stats(str(pstats_path))
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{name} ({Path(file).name}:{line})", "calls": calls, "own_s": own,
                     "cumulative_s": cumulative})
    return sorted(rows, key=lambda row: -row["own_s"])[:count]


def run_server(config: str, args: argparse.Namespace, model, prompts: list[list[int]], folder: Path) -> tuple[
        list[dict], dict[int, list[list[int]]], list[dict]]:
    """Rows per concurrency, greedy outputs per concurrency and (``--cprofile``) the top functions."""
    from sglang_spec_testbed.step_timing import CPROFILE_ENV, PROFILE_ENV
    from sglang_spec_testbed.server import SGLangServer, cpu_launch_args, free_port

    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("steps.jsonl", "decode.pstats", "plan.jsonl"):
        (folder / stale).unlink(missing_ok=True)
    plans_path = folder / "plan.jsonl"
    env = dict(os.environ, **{PROFILE_ENV: str(folder), CPROFILE_ENV: "1" if args.cprofile else "0",
                              PLAN_LOG_ENV: str(plans_path)})
    port = free_port()
    launch = cpu_launch_args(model, port, speculative=config not in PLAIN_CONFIGS,
                             extra=tree_args(config, args, model.profile))
    steps_path = folder / "steps.jsonl"
    rows, outputs = [], {}
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    with SGLangServer(launch, port, folder / "server.log", env=env) as server:
        server.generate(prompts[:1], dict(params, max_new_tokens=4))  # warm-up: first-call costs out of the steps
        seen = len(read_steps(steps_path, 0))
        planned = len(read_plans(plans_path, 0))
        for concurrency in args.concurrency:
            answers = server.generate(prompts[:concurrency], params)
            steps = read_steps(steps_path, seen)
            plans = read_plans(plans_path, planned)
            seen += len(steps)
            planned += len(plans)
            rows.append(dict(summarise(config, concurrency, steps, answers), by_kind=split_by_kind(steps, plans)))
            outputs[concurrency] = [answer["output_ids"] for answer in answers]
            row = rows[-1]
            print(f"{config:<9} x{concurrency}: {row['steps']} steps, {row['step_ms']:.1f} ms/step "
                  f"(target {row['target_ms']:.1f}, draft {row['draft_ms']:.1f}, overhead {row['overhead_ms']:.1f}), "
                  f"{row['tokens_per_step']:.2f} tokens/step, {row['decode_mode_steps']} timed steps decoded "
                  f"(target forward in DECODE mode)", flush=True)
    top = top_functions(folder / "decode.pstats", args.top) if args.cprofile else []
    return rows, outputs, top


def compare_to_plain(rows: list[dict], outputs: dict[str, dict[int, list[list[int]]]]) -> None:
    """Each row's ``speedup`` (plain decoding's ms per token over its own, at its concurrency) and
    ``greedy_identical`` (its outputs against plain decoding's), plain decoding being ``plain`` where it ran, else
    ``plain-sync`` (neither: nothing added); per plan kind (``split_by_kind``), its tokens per second over plain
    decoding's as served and with its drafting free (``bound_by_kind``)."""
    baseline = next((config for config in PLAIN_CONFIGS if config in outputs), None)
    plain = {row["concurrency"]: row for row in rows if row["config"] == baseline}
    for row in rows:
        if row["concurrency"] in plain:
            row["speedup"] = plain[row["concurrency"]]["ms_per_token"] / row["ms_per_token"]
            bound_by_kind(row.get("by_kind", {}), plain[row["concurrency"]])
        if baseline is not None and row["config"] != baseline:
            row["greedy_identical"] = (outputs[row["config"]][row["concurrency"]]
                                       == outputs[baseline][row["concurrency"]])


def bound_by_kind(kinds: dict[str, dict], plain: dict) -> None:
    """Per plan kind (``split_by_kind``'s entries, in place), against ``plain`` (plain decoding's ``summarise`` row at
    the same concurrency): ``x_plain``, its tokens per second over plain decoding's; ``free_drafting_x_plain``, the
    same were its step only its target forward and a plain step's other work (its draft forwards free, its host
    work a plain step's): the most its verify lets it gain at the tokens it committed, whatever the drafting costs."""
    plain_per_second = 1e3 / plain["ms_per_token"]
    for kind in kinds.values():
        kind["x_plain"] = kind["tokens_per_second"] / plain_per_second
        bound_ms = kind["target_ms"] + plain["overhead_ms"]
        kind["free_drafting_x_plain"] = 1e3 * kind["tokens_per_step"] / bound_ms / plain_per_second


def main(argv=None) -> int:
    args = parse_args(argv)
    check_output_path(args.out, force=True)
    from transformers import AutoTokenizer

    from sglang_spec_testbed.server import prepare_model
    from sglang_spec.train.prompts import humaneval_prompts

    model = prepare_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model.target_dir)
    if args.workload == "heldout":
        specs = humaneval_prompts(HELD_OUT_FIRST, HELD_OUT_FIRST + max(args.concurrency) - 1)
        conversations = [list(spec.messages) for spec in specs]
    else:
        from serving_sweep import serving_questions

        conversations = [[{"role": "user", "content": question}]
                         for question in serving_questions(args.workload)[:max(args.concurrency)]]
    prompts = [list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)) for messages in conversations]
    rows, outputs, profiles = [], {}, {}
    for config in args.configs:
        config_rows, outputs[config], profiles[config] = run_server(config, args, model, prompts,
                                                                    args.out.parent / config)
        rows += config_rows
    compare_to_plain(rows, outputs)
    command = ("python bench/cpu_step_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    write_text_atomic(args.out, json.dumps({"rows": rows, "top_functions": profiles, "command": command,
                                            "cprofile": args.cprofile, "max_new_tokens": args.max_new_tokens,
                                            "environment": environment()}, indent=1) + "\n")
    for config, top in profiles.items():
        if top:
            print(f"\n{config}: cProfile, top {len(top)} by own time over the decode steps")
            print("\n".join(markdown_table(["function", "calls", "own s", "cumulative s"],
                                           [[t["function"], t["calls"], f"{t['own_s']:.2f}",
                                             f"{t['cumulative_s']:.2f}"] for t in top])))
    print()
    print("\n".join(markdown_table(
        ["server", "requests", "steps", "DECODE-mode", "ms / step", "target fwd", "draft fwds", "overhead",
         "tokens / step", "ms / token", "speedup"],
        [[row["config"], row["concurrency"], row["steps"], row["decode_mode_steps"], f"{row['step_ms']:.1f}",
          f"{row['target_ms']:.1f}",
          f"{row['draft_ms']:.1f}", f"{row['overhead_ms']:.1f}", f"{row['tokens_per_step']:.2f}",
          f"{row['ms_per_token']:.1f}", f"{row['speedup']:.2f}x" if "speedup" in row else ""] for row in rows])))
    split = [[row["config"], row["concurrency"], name, kind["steps"], f"{kind['step_ms']:.1f}",
              f"{kind['target_ms']:.1f}", f"{kind['draft_ms']:.1f}", f"{kind['overhead_ms']:.1f}",
              f"{kind['verify_tokens_per_step']:.1f}", f"{kind['tokens_per_step']:.2f}",
              f"{kind['tokens_per_second']:.1f}", _times(kind.get("x_plain")),
              _times(kind.get("free_drafting_x_plain"))]
             for row in rows for name, kind in row["by_kind"].items()]
    if split:
        print("\nTree auto's decode steps by the plan's kind (timed steps); x plain: tokens per second over plain "
              "decoding's; drafting free: the same, the step's draft forwards free and its other work a plain step's")
        print("\n".join(markdown_table(
            ["server", "requests", "steps of", "steps", "ms / step", "target fwd", "draft fwds", "overhead",
             "verify tokens / step", "tokens / step", "tokens / s", "x plain", "x plain, drafting free"], split)))
    print(f"\n{command}")
    return 0 if all(row.get("greedy_identical", True) for row in rows) else 1


def _times(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


if __name__ == "__main__":
    sys.exit(exit_status(main))
