"""Hybrid trees against prompt lookup: the benchmark a user of this machine would run.

    python bench/hybrid.py                           # SmolLM2 + shipped head, bench/workloads/*.jsonl, T=0 and 0.7
    python bench/hybrid.py --prompts mine.jsonl      # your prompts ({"messages": [...]} or {"prompt": ...} lines)
    python bench/hybrid.py --quick                   # tiny-deepseek on toy prompts, seconds (CI)

Side by side in one run, per workload and temperature, one prompt after another (batch 1):

* ``plain``: the project's plain decoding (the static-cache runner where the model allows: the baseline of every
  speedup), and ``hf_plain``: Hugging Face's own ``generate``;
* ``hf_lookup_k3`` / ``k5`` / ``k10``: Hugging Face prompt-lookup decoding with 3, 5 and 10 draft tokens;
* ``mtp``: an MTP-only tree (``--mtp-tree``), ``lookup``: the context-lookup tree, ``hybrid``: both in one tree,
  ``auto``: the hybrid candidates with each step's tree (or none) chosen from the measured cost curve.

Per method: tokens/s and its ratio to ``plain``, accept length (tokens per step, bonus included), greedy identity
with ``plain`` (near-ties < 1e-4 counted apart), inter-token latency p50 / p99 as a streaming client sees it (a step
that emits k tokens shows one gap of the step's time and k - 1 gaps of zero), tokens per drafting source, and the
1-minute load average around the timed runs. Also the machine's limits (``limits.py``) and the verify-cost curve.
Writes JSON, Markdown and a plot. The workloads in ``bench/workloads/`` were written for this benchmark and are
never used for training or calibration.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from harness import (
    COST_SIZES,
    LIMIT_SIZES,
    QUICK_COST_SIZES,
    QUICK_LIMIT_SIZES,
    REPO,
    accept_cell,
    greedy_identity,
    hf_generate,
    identical_cell,
    markdown_table,
    model_environment,
    one_by_one,
    repeating_toy_prompts,
)
from limits import measure as measure_limits
from limits import render as render_limits

from sglang_spec.catalog import load_model
from sglang_spec.decode.autotune import measure_costs
from sglang_spec.decode.decoder import GenerationConfig, RequestOutput, SpeculativeDecoder, generate_plain
from sglang_spec.errors import SpecError, exit_status
from sglang_spec.files import atomic_path, check_output_path, write_text_atomic
from sglang_spec.models.loading import LoadedModel, load_head_for, shipped_profile_path
from sglang_spec.sampling import SamplingParams
from sglang_spec.train.generate_traffic import prompt_tokens
from sglang_spec.train.prompts import load_prompts
from sglang_spec.costs import CostCurve
from sglang_spec.tree.sizing import choose_auto
from sglang_spec.tree.profile import SOURCE_NAMES
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile

WORKLOADS = REPO / "bench" / "workloads"
METHODS = ("plain", "hf_plain", "hf_lookup_k3", "hf_lookup_k5", "hf_lookup_k10", "mtp", "lookup", "hybrid", "auto")

# What the hybrid trees must reach on this machine to be worth running (``done_when`` checks each run against them).
# On code and extraction, which copy long spans of their context, Hugging Face's prompt lookup is the ready-made
# alternative: the trees must be clearly faster than its best setting, by more than reruns of a workload differ
OVER_BEST_LOOKUP = 1.15
# ... and half again plain decoding's tokens/s there, to pay for the head and the wider verify
OVER_PLAIN = 1.5
# Chat copies little: there --auto must fall back to plain steps rather than lose to plain decoding (3%: a rerun's
# noise), at every temperature
CHAT_OVER_PLAIN = 0.97
# A verify of 16 tree tokens against one plain step. The verify is most of a tree step, so a step's speedup is
# about its accept length over this ratio: at 1.5 a 16-node tree needs 2.25 tokens a step to reach OVER_PLAIN
VERIFY16_OVER_PLAIN = 1.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", action="append", default=None, metavar="FILE.jsonl",
                        help="a workload per file (default: bench/workloads/{code,chat,extraction}.jsonl)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts-per-workload", type=int, default=0, metavar="N",
                        help="only the first N prompts of each workload (0 = all; a shorter run on a busy machine)")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--mtp-tree", default="specexec:8:4", metavar="POLICY:BUDGET:DEPTH",
                        help="the MTP-only tree (default specexec:8:4)")
    parser.add_argument("--hybrid", default="16:10:2", metavar="BUDGET:DEPTH:MTP_LEVELS",
                        help="the lookup and hybrid trees (default 16:10:2; lookup ignores the levels)")
    parser.add_argument("--auto", default="32:12:3", metavar="BUDGET:DEPTH:MTP_LEVELS",
                        help="the most --auto may use per step (default 32:12:3)")
    parser.add_argument("--context", type=int, default=300, help="context of the limits table")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "hybrid.json")
    parser.add_argument("--quick", action="store_true",
                        help="tiny-deepseek, toy prompts, 16 tokens, one thread (seconds; CI)")
    args = parser.parse_args(argv)
    if args.quick:
        # one thread: the tiny model's ops are microseconds, and two threads on a shared 2-core CPU wait on each
        # other for a time slice per op (140 ms a step instead of a few)
        args.model, args.max_new_tokens, args.context = "tiny-deepseek", 16, 64
        args.hybrid, args.auto, args.threads = "8:6:1", "12:8:2", args.threads or 1
    return args


@dataclass
class Row:
    workload: str
    temperature: float
    method: str
    tokens: int
    seconds: float
    tokens_per_second: float
    speedup: float = math.nan  # over `plain` in the same run
    speedup_over_hf_plain: float = math.nan
    accept_length: float = math.nan  # tokens per step, bonus included (NaN for Hugging Face's runs)
    identical: bool | None = None  # greedy: every output equals plain decoding's (near-ties counted apart)
    near_ties: int = 0
    latency_p50_ms: float = math.nan  # inter-token gaps a streaming client sees
    latency_p99_ms: float = math.nan
    step_p50_ms: float = math.nan
    plain_steps: int = 0  # steps without a tree (auto)
    steps: int = 0
    tokens_by_source: dict[str, int] = field(default_factory=dict)
    load: tuple[float, float] = (math.nan, math.nan)  # 1-minute load average before and after


def gaps_ms(times_per_request: list[list[float]]) -> list[float]:
    """Inter-token gaps (ms) after each request's first token."""
    return [1e3 * (b - a) for times in times_per_request for a, b in zip(times, times[1:])]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def source_counts(requests: list[RequestOutput]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        for source in [s for step in request.steps for s in step.sources][: len(request.tokens)]:
            counts[SOURCE_NAMES[source]] = counts.get(SOURCE_NAMES[source], 0) + 1
    return counts


@dataclass
class Setup:
    loaded: LoadedModel
    head: Any
    profile: AcceptanceProfile
    costs: CostCurve
    args: argparse.Namespace


def sizes(text: str, option: str = "--hybrid") -> tuple[int, int, int]:
    parts = text.split(":")
    if len(parts) != 3 or not all(part.isascii() and part.isdigit() and len(part) < 6 for part in parts):
        raise SpecError(f"{option} {text!r}: give BUDGET:DEPTH:MTP_LEVELS, e.g. 16:10:2")
    budget, depth, levels = (int(part) for part in parts)
    return budget, depth, levels


def decoders(setup: Setup) -> dict[str, Callable[[], SpeculativeDecoder]]:
    loaded, head, args = setup.loaded, setup.head, setup.args
    name, budget, depth = args.mtp_tree.split(":")
    mtp = TreePolicy(name, budget=int(budget), depth=int(depth), topk=4, profile=setup.profile)
    hybrid_budget, hybrid_depth, levels = sizes(args.hybrid)
    auto_budget, auto_depth, auto_levels = sizes(args.auto)
    sources = setup.profile.sources
    common: dict[str, Any] = dict(max_ngram=sources.max_ngram if sources else 8, profile=setup.profile)
    auto = choose_auto(TreePolicy("hybrid", auto_budget, auto_depth, mtp_levels=auto_levels, **common), setup.costs)
    assert auto.policy is not None  # best-first shapes are sized per step, never refused outright
    auto_policy = auto.policy
    return {
        "mtp": lambda: SpeculativeDecoder(loaded.model, head, mtp),
        "lookup": lambda: SpeculativeDecoder(loaded.model, None, TreePolicy(
            "lookup", hybrid_budget, hybrid_depth, **common)),
        "hybrid": lambda: SpeculativeDecoder(loaded.model, head, TreePolicy(
            "hybrid", hybrid_budget, hybrid_depth, mtp_levels=levels, **common)),
        "auto": lambda: SpeculativeDecoder(loaded.model, head, auto_policy),
    }


def run_workload(setup: Setup, workload: str, prompts: list[list[int]], config: GenerationConfig,
                 methods: list[str]) -> list[Row]:
    """Every method over one workload's prompts at one temperature."""
    temperature = config.sampling.temperature
    rows: list[Row] = []
    load = os.getloadavg()[0]
    plain = generate_plain(setup.loaded.model, prompts, config)
    plain_row = Row(workload, temperature, "plain", plain.generated_tokens, plain.stats.total_seconds,
                    plain.tokens_per_second, accept_length=1.0, steps=plain.stats.steps,
                    tokens_by_source=source_counts(plain.requests), load=(load, os.getloadavg()[0]))
    times = [request.token_times() for request in plain.requests]
    gaps = gaps_ms(times)
    plain_row.latency_p50_ms, plain_row.latency_p99_ms = percentile(gaps, 50), percentile(gaps, 99)
    plain_row.step_p50_ms = plain_row.latency_p50_ms
    rows.append(plain_row)
    print(f"  {workload:>10} T={temperature} {'plain':>13}: {plain_row.tokens_per_second:6.1f} tok/s x1.00  "
          f"(load {plain_row.load[0]:.2f})", flush=True)
    makers = decoders(setup)
    for method in methods:
        if method == "plain":
            continue
        load = os.getloadavg()[0]
        if method.startswith("hf_"):
            lookup = None if method == "hf_plain" else int(method.rsplit("k", 1)[1])
            run = hf_generate(setup.loaded, prompts, config, lookup)
            row = Row(workload, temperature, method, sum(len(t) for t in run.tokens), run.seconds,
                      run.tokens_per_second)
            gaps = gaps_ms(run.times)
            row.identical = run.identical_to(plain, config)
        else:
            output = one_by_one(makers[method](), prompts, config)
            row = Row(workload, temperature, method, output.generated_tokens, output.stats.total_seconds,
                      output.tokens_per_second, accept_length=output.accept_length_mean, steps=output.stats.steps,
                      tokens_by_source=source_counts(output.requests))
            row.plain_steps = sum(1 for r in output.requests for step in r.steps[1:] if step.tree_nodes == 1)
            gaps = gaps_ms([request.token_times() for request in output.requests])
            steps = [1e3 * (b.time - a.time) for r in output.requests for a, b in zip(r.steps, r.steps[1:])]
            row.step_p50_ms = percentile(steps, 50)
            if config.sampling.greedy:
                row.identical, row.near_ties = greedy_identity(output, plain)
        row.latency_p50_ms, row.latency_p99_ms = percentile(gaps, 50), percentile(gaps, 99)
        row.load = (load, os.getloadavg()[0])
        rows.append(row)
        print(f"  {workload:>10} T={temperature} {method:>13}: {row.tokens_per_second:6.1f} tok/s "
              f"x{row.tokens_per_second / plain_row.tokens_per_second:.2f}"
              + (f", accept length {row.accept_length:.2f}" if not math.isnan(row.accept_length) else "")
              + ("" if row.identical in (None, True) else "  NOT IDENTICAL")
              + f"  (load {row.load[0]:.2f})", flush=True)
    hf_plain = next((row for row in rows if row.method == "hf_plain"), None)
    for row in rows:
        row.speedup = row.tokens_per_second / plain_row.tokens_per_second
        if hf_plain is not None:
            row.speedup_over_hf_plain = row.tokens_per_second / hf_plain.tokens_per_second
    return rows


def workloads(args: argparse.Namespace, loaded: LoadedModel) -> dict[str, list[list[int]]]:
    if args.quick:
        return {"toy": repeating_toy_prompts(loaded)}
    files = args.prompts or [str(WORKLOADS / f"{name}.jsonl") for name in ("code", "chat", "extraction")]
    count = args.prompts_per_workload or None
    return {Path(file).stem: [prompt_tokens(loaded, spec) for spec in load_prompts(file)[:count]] for file in files}


def done_when(rows: list[Row], limits: dict[str, Any]) -> list[str]:
    """The targets (the constants above), checked on this run: for the fixed-shape hybrid tree (``hybrid``) and for
    the hybrid candidates with each step's tree chosen by cost (``auto``), and chat's ``auto`` at every temperature
    run."""
    lines = []
    greedy = [row for row in rows if row.temperature == 0]
    by = {(row.workload, row.method): row for row in greedy}
    for workload in ("code", "extraction"):
        lookups = [by[(workload, m)] for m in ("hf_lookup_k3", "hf_lookup_k5", "hf_lookup_k10") if (workload, m) in by]
        best = max(lookups, key=lambda row: row.tokens_per_second) if lookups else None
        for method in ("hybrid", "auto"):
            if (workload, method) not in by:
                continue
            row = by[(workload, method)]
            if best is not None:
                ratio = row.tokens_per_second / best.tokens_per_second
                lines.append(f"{workload}: {method} / best prompt lookup ({best.method}) = {ratio:.3f} "
                             f"(target >= {OVER_BEST_LOOKUP}): " + ("met" if ratio >= OVER_BEST_LOOKUP else "NOT met"))
            lines.append(f"{workload}: {method} / plain = {row.speedup:.2f} (target >= {OVER_PLAIN}): "
                         + ("met" if row.speedup >= OVER_PLAIN else "NOT met"))
    for row in rows:
        if row.workload == "chat" and row.method == "auto":
            lines.append(f"chat T={row.temperature}: auto / plain = {row.speedup:.2f} (target >= {CHAT_OVER_PLAIN}): "
                         + ("met" if row.speedup >= CHAT_OVER_PLAIN else "NOT met"))
    identical = all(row.identical is not False for row in greedy if not row.method.startswith("hf_"))
    lines.append("greedy output identical to plain decoding everywhere: " + ("yes" if identical else "NO"))
    ratio = limits["verify16_over_plain"]
    lines.append(f"verify of 16 tree tokens / plain step at {limits['context']} tokens = {ratio:.2f} "
                 f"(target <= {VERIFY16_OVER_PLAIN}): " + ("met" if ratio <= VERIFY16_OVER_PLAIN else "NOT met"))
    return lines


def check_options(args: argparse.Namespace) -> tuple[list[float], list[str]]:
    """Everything checkable before a model loads: the output paths, temperatures, methods, tree sizes, prompt
    files (a bad one fails in a second, not after the run)."""
    for path in (args.out, args.out.with_suffix(".md"), args.out.with_suffix(".png")):
        check_output_path(path, force=True)
    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise SpecError(f"--temperatures {args.temperatures!r}: give numbers separated by commas") from None
    if not temperatures or not all(0 <= t <= 100 for t in temperatures):
        raise SpecError(f"--temperatures {args.temperatures!r}: each in [0, 100]")
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise SpecError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    for option, text in (("--hybrid", args.hybrid), ("--auto", args.auto)):
        budget, depth, levels = sizes(text, option)
        TreePolicy("hybrid", budget, depth, mtp_levels=levels)
    name, budget, depth = args.mtp_tree.split(":") if args.mtp_tree.count(":") == 2 else ("", "", "")
    if not (budget.isdigit() and depth.isdigit()):
        raise SpecError(f"--mtp-tree {args.mtp_tree!r}: give POLICY:BUDGET:DEPTH, e.g. specexec:8:4")
    TreePolicy(name, budget=int(budget), depth=int(depth), topk=4, profile=AcceptanceProfile.load(None))
    if args.max_new_tokens < 1 or args.context < 16 or args.prompts_per_workload < 0:
        raise SpecError("--max-new-tokens must be >= 1, --context >= 16 and --prompts-per-workload >= 0")
    for file in args.prompts or []:
        load_prompts(file)
    return temperatures, methods


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        temperatures, methods = check_options(args)
    except SpecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return run(args, argv, temperatures, methods)
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (tests) gets its setting back


def run(args: argparse.Namespace, argv: list[str] | None, temperatures: list[float], methods: list[str]) -> int:
    load_start = os.getloadavg()
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    loaded = load_model(args.model)
    head = load_head_for(loaded, None)
    prompts_by_workload = workloads(args, loaded)
    loaded.check_lengths([len(p) for prompts in prompts_by_workload.values() for p in prompts], args.max_new_tokens)
    print(f"machine limits ({args.context}-token context) ...", flush=True)
    with torch.no_grad():
        limits = measure_limits(loaded.model, args.context, sizes=QUICK_LIMIT_SIZES if args.quick else LIMIT_SIZES,
                                repeats=3 if args.quick else 9, quick=args.quick)
    print(render_limits(limits), flush=True)
    rows: list[Row] = []
    costs_by_temperature = {}
    for temperature in temperatures:
        sampling = SamplingParams(temperature=temperature)
        print(f"measuring the cost curve at T={temperature} ...", flush=True)
        costs = measure_costs(loaded.model, head, sizes=QUICK_COST_SIZES if args.quick else COST_SIZES,
                              repeats=2 if args.quick else 5, sampling=sampling)
        costs_by_temperature[temperature] = costs
        profile = AcceptanceProfile.load(shipped_profile_path(loaded.name, temperature))
        setup = Setup(loaded, head, profile, costs, args)
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                                  eos_token_ids=loaded.eos_token_ids)
        generate_plain(loaded.model, next(iter(prompts_by_workload.values()))[:1],
                       GenerationConfig(max_new_tokens=4, sampling=sampling))  # warm-up
        for workload, prompts in prompts_by_workload.items():
            rows += run_workload(setup, workload, prompts, config, methods)
    report = {
        "environment": model_environment(loaded, load_average_start=load_start, load_average_end=os.getloadavg(),
                                         wall_seconds=time.perf_counter() - started),
        "command": " ".join(["python", "bench/hybrid.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: str(v) for k, v in vars(args).items()},
        "workloads": {name: len(prompts) for name, prompts in prompts_by_workload.items()},
        "limits": limits,
        "costs": {str(t): c.to_json() for t, c in costs_by_temperature.items()},
        "rows": [asdict(row) for row in rows],
        "done_when": done_when(rows, limits),
    }
    write_text_atomic(args.out, json.dumps(report, indent=1) + "\n")
    markdown = args.out.with_suffix(".md")
    write_text_atomic(markdown, render_markdown(report))
    draw_plot(report, args.out.with_suffix(".png"))
    print(render_markdown(report))
    print(f"wrote {args.out}, {markdown} and {args.out.with_suffix('.png')}")
    return 0


def render_markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"# Hybrid trees vs prompt lookup ({env['device']}, {env['model']} {env['dtype']})", "",
             f"Command: `{report['command']}` (commit {env['commit']}, torch {env['torch']}, "
             f"{env['threads']} threads). 1/5/15-minute load average "
             f"{'/'.join(f'{x:.2f}' for x in env['load_average_start'])} at the start, "
             f"{'/'.join(f'{x:.2f}' for x in env['load_average_end'])} at the end; {env['wall_seconds'] / 60:.0f} "
             "minutes.", "",
             "Speedup = tokens/s over the project's plain decoding (`plain`) in the same run; `vs HF` = over Hugging "
             "Face's own plain `generate`. Accept length = tokens per step, bonus included. Latency = gaps between "
             "tokens as a streaming client sees them. Load = the 1-minute load average before the method's runs.", ""]
    for temperature in sorted({row["temperature"] for row in report["rows"]}):
        lines += [f"## Temperature {temperature}", ""]
        lines += markdown_table(
            ["workload", "method", "tok/s", "speedup", "vs HF", "accept length", "identical", "latency p50 / p99 (ms)",
             "tokens by source", "plain steps", "load"],
            [[row["workload"], row["method"], f"{row['tokens_per_second']:.1f}", f"{row['speedup']:.2f}",
              f"{row['speedup_over_hf_plain']:.2f}", accept_cell(row["accept_length"]),
              identical_cell(row["identical"], row["near_ties"]),
              f"{row['latency_p50_ms']:.1f} / {row['latency_p99_ms']:.1f}",
              ", ".join(f"{k} {v}" for k, v in sorted(row["tokens_by_source"].items())),
              f"{row['plain_steps']} / {row['steps']}" if row["method"] == "auto" else "", f"{row['load'][0]:.2f}"]
             for row in report["rows"] if row["temperature"] == temperature])
        lines.append("")
    lines += ["## This machine's limits", "", render_limits(report["limits"]), "## Targets", ""]
    lines += [f"* {line}" for line in report["done_when"]]
    return "\n".join(lines) + "\n"


def draw_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib  # the optional `bench` extra: only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    temperatures = sorted({row["temperature"] for row in rows})
    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    figure, axes = plt.subplots(2, len(temperatures), figsize=(7 * len(temperatures), 9), squeeze=False)
    width = 0.8 / len(methods)
    for column, temperature in enumerate(temperatures):
        chosen = {(r["workload"], r["method"]): r for r in rows if r["temperature"] == temperature}
        for panel, (metric, label) in enumerate((("speedup", "tokens/s over plain decoding"),
                                                 ("latency_p99_ms", "inter-token latency p99 (ms); dot = p50"))):
            axis = axes[panel][column]
            for index, method in enumerate(methods):
                xs = [w + (index - len(methods) / 2 + 0.5) * width for w in range(len(workloads))]
                values = [chosen[(w, method)][metric] if (w, method) in chosen else 0 for w in workloads]
                axis.bar(xs, values, width, label=method)
                if metric == "latency_p99_ms":
                    p50 = [chosen[(w, method)]["latency_p50_ms"] if (w, method) in chosen else 0 for w in workloads]
                    axis.scatter(xs, p50, color="black", s=6, zorder=3)
            if metric == "speedup":
                axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
            axis.set_xticks(range(len(workloads)), workloads)
            axis.set_ylabel(label)
            axis.set_title(f"temperature {temperature}")
            if panel == 0 and column == 0:
                axis.legend(fontsize=7, ncol=3)
    figure.tight_layout()
    with atomic_path(path) as temporary:
        figure.savefig(temporary, dpi=110, format="png")
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(exit_status(main))  # bad input found later (a prompt past the context) is one line too
