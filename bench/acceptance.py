"""What tree policies buy with an MTP head, measured side by side in one run on held-out prompts.

    python bench/acceptance.py                 # SmolLM2 + the shipped generic and code heads, HumanEval 120-163
    python bench/acceptance.py --quick         # tiny-deepseek, a handful of configurations (seconds; CI)

For every head x temperature it runs plain decoding and Hugging Face's prompt-lookup decoding as baselines, then
every policy x budget x depth through the reference decoder (batch 1, one prompt after another, like a single
user), and records mean accept length (tokens per step, bonus included), tokens/s and speedup over plain decoding
measured in the same run. It also measures the verify-cost curve (target forward time for 1..64 tree tokens) and
predicts each configuration's speedup from its accept length and the costs, to show how well
``accept length / cost`` explains the measurement; reports the head-quality numbers of the issue's baseline
(depth-1 top-k acceptance, chain and tree accept lengths); and runs the hardware-aware choice (``--auto``).

Writes JSON (everything), a Markdown table and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from harness import (
    COST_SIZES,
    REPO,
    accept_cell,
    greedy_identity,
    head_quality,
    hf_generate,
    identical_cell,
    load_heads,
    load_profiles,
    load_prompt_tokens,
    markdown_table,
    model_environment,
    one_by_one,
)

from sglang_spec.catalog import load_model
from sglang_spec.cli.parser import OneLineErrorParser, comma_list, integer
from sglang_spec.cli.parser import temperature as temperature_arg
from sglang_spec.decode.autotune import measure_costs, time_draft_level
from sglang_spec.decode.decoder import (
    GenerationConfig,
    GenerationOutput,
    SpeculativeDecoder,
    generate_plain,
)
from sglang_spec.decode.target import TransformersRunner
from sglang_spec.errors import exit_status
from sglang_spec.files import check_output_path, write_text_atomic
from sglang_spec.models.loading import LoadedModel
from sglang_spec.mtp.head import MTPHead
from sglang_spec.sampling import SamplingParams
from sglang_spec.costs import CostCurve, predicted_speedup
from sglang_spec.tree.sizing import choose_speculation
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile
from sglang_spec.tree.sequoia import sequoia_plan
from sglang_spec.tree.token_tree import MAX_BUDGET, MAX_DEPTH

PROMPT_LOOKUP_TOKENS = 10  # draft tokens per step of the prompt-lookup baseline: prompt lookup decoding's own default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--heads", default=None,
                        help="name=PATH,... (default: the shipped generic and code heads of the model)")
    parser.add_argument("--profiles", default=None,
                        help="name@temperature=PATH,... acceptance profiles per head (default: shipped ones)")
    parser.add_argument("--prompts", default="humaneval:120-163")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--policies", default="chain,eagle,sequoia,specexec")
    parser.add_argument("--budgets", type=comma_list(integer(1, MAX_BUDGET)), default="4,8,16,32,64")
    parser.add_argument("--depths", type=comma_list(integer(1, MAX_DEPTH)), default="3,6")
    parser.add_argument("--temperatures", type=comma_list(temperature_arg), default="0,0.7")
    parser.add_argument("--tree-sizes", type=comma_list(integer(1, MAX_BUDGET)), default="16,32,168",
                        help="tree budgets for the head-quality table")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "acceptance.json")
    parser.add_argument("--quick", action="store_true", help="tiny-deepseek and a few configurations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.prompts, args.num_prompts, args.max_new_tokens = "tiny-deepseek", "toy", 4, 24
        args.budgets, args.depths, args.temperatures, args.tree_sizes = [4, 8], [3], [0.0, 0.7], [8]
    return args


@dataclass
class Row:
    head: str
    temperature: float
    method: str  # plain | prompt_lookup | chain | eagle | sequoia | specexec | auto
    budget: int
    depth: int
    accept_length: float
    tokens_per_second: float
    speedup: float
    mean_tree_nodes: float
    steps: int
    draft_seconds: float
    verify_seconds: float
    total_seconds: float
    identical: bool | None  # temperature 0: every output equals plain decoding (near-ties counted apart)
    near_ties: int
    # from the measured accept length and the cost curve (costs.py's step_seconds)
    predicted_speedup: float | None = None
    # sequoia: the profile's expected accept length F(T), and the speedup the cost model predicts from it: the
    # number `sglang-spec generate --auto` prints for the same tree, costs and profile
    predicted_accept_length: float | None = None
    profile_predicted_speedup: float | None = None


@dataclass(frozen=True)
class Sweep:
    """What every configuration of one temperature runs against."""

    loaded: LoadedModel
    prompts: list[list[int]]
    config: GenerationConfig
    plain: GenerationOutput
    costs: CostCurve


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_output_path(args.out, force=True)  # a bad --out fails now, not after the run
    torch.manual_seed(args.seed)
    loaded = load_model(args.model)
    heads = load_heads(loaded, args.heads)
    prompts, prompt_ids = load_prompt_tokens(loaded, args.prompts, args.num_prompts, args.seed)
    temperatures = args.temperatures
    profiles = load_profiles(loaded, heads, args.profiles, temperatures)
    first_head = next(iter(heads.values()))
    print(f"measuring the verify-cost curve on {platform.processor() or 'this machine'} ...", flush=True)
    # per temperature: sampled verification costs more per step than greedy
    costs_by_temperature = {t: measure_costs(loaded.model, first_head, sizes=COST_SIZES,
                                             sampling=SamplingParams(temperature=t)) for t in temperatures}
    draft_vocabulary = {name: draft_vocab_timing(loaded, head) for name, head in heads.items()}
    rows: list[Row] = []
    quality = {}
    progress = Progress(len(heads) * len(temperatures) * len(args.policies.split(",")) * len(args.budgets)
                        * len(args.depths))
    for temperature in temperatures:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=temperature),
                                  seed=args.seed, eos_token_ids=loaded.eos_token_ids)
        sweep = Sweep(loaded, prompts, config, generate_plain(loaded.model, prompts, config),
                      costs_by_temperature[temperature])
        rows.append(row_from(sweep, "-", "plain", 0, 0, sweep.plain))
        rows.append(prompt_lookup_row(sweep))
        for head_name, head in heads.items():
            profile = profiles[(head_name, temperature)]
            rows += policy_rows(sweep, head_name, head, profile, args, progress)
            rows.append(auto_row(sweep, head_name, head, profile))
            if temperature == 0:
                quality[head_name] = head_quality(loaded, head, prompts, sweep.plain, profile,
                                                  args.tree_sizes, config)
    report = {
        "environment": model_environment(loaded),
        "command": " ".join([Path(sys.executable).name, "bench/acceptance.py", *(argv or sys.argv[1:])]),
        "config": {k: str(v) for k, v in vars(args).items()},
        "prompts": prompt_ids,
        "costs": costs_by_temperature[temperatures[0]].to_json(),
        "costs_by_temperature": {str(t): c.to_json() for t, c in costs_by_temperature.items()},
        "rows": [asdict(row) for row in rows],
        "head_quality": quality,
        "draft_vocabulary": draft_vocabulary,
        "prediction": prediction_fit(rows),
    }
    write_text_atomic(args.out, json.dumps(report, indent=1) + "\n")
    markdown = args.out.with_suffix(".md")
    write_text_atomic(markdown, render_markdown(report))
    draw_plots(report, args.out.parent, args.out.stem)
    print(render_markdown(report))
    print(f"wrote {args.out}, {markdown} and plots in {args.out.parent}")
    return 0


class Progress:
    """Counts configurations and prints one line per run with the elapsed minutes."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.perf_counter()

    def step(self) -> None:
        self.done += 1

    def line(self, text: str) -> None:
        minutes = (time.perf_counter() - self.start) / 60
        print(f"[{self.done}/{self.total} {minutes:.0f} min] {text}", flush=True)


def policy_rows(sweep: Sweep, head_name: str, head: MTPHead, profile: AcceptanceProfile,
                args: argparse.Namespace, progress: Progress) -> list[Row]:
    """Every policy x budget x depth through the reference decoder, one prompt at a time."""
    rows = []
    temperature = sweep.config.sampling.temperature
    seen: set[tuple[str, int, int]] = set()
    for policy_name in args.policies.split(","):
        for budget in args.budgets:
            for depth in args.depths:
                progress.step()
                # a chain has min(budget, depth) nodes: run each distinct chain once
                key = (policy_name, min(budget, depth) if policy_name == "chain" else budget, depth)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    policy = TreePolicy(policy_name, budget=budget, depth=depth, profile=profile)
                except Exception as error:  # e.g. eagle slots too few: record why and move on
                    print(f"  skip {policy_name} {budget}/{depth}: {error}")
                    continue
                output = one_by_one(SpeculativeDecoder(sweep.loaded.model, head, policy), sweep.prompts, sweep.config)
                row = finish_row(sweep, head_name, policy, output, profile)
                rows.append(row)
                progress.line(f"{head_name} T={temperature} {policy_name:>8} b={budget:<3} d={depth}: AL "
                              f"{row.accept_length:.2f}, {row.tokens_per_second:.1f} tok/s, x{row.speedup:.2f}"
                              + ("" if row.identical in (None, True) else "  NOT IDENTICAL"))
    return rows


def auto_row(sweep: Sweep, head_name: str, head: MTPHead, profile: AcceptanceProfile) -> Row:
    """The hardware-aware choice (``--auto``) for this head, run like the others."""
    choice = choose_speculation(profile, sweep.costs, max_depth=8)
    if choice.budget > 0:
        policy = TreePolicy("sequoia", budget=choice.budget, depth=choice.depth, profile=profile)
        output = one_by_one(SpeculativeDecoder(sweep.loaded.model, head, policy), sweep.prompts, sweep.config)
        row = finish_row(sweep, head_name, policy, output, profile)
        row.method = "auto"
    else:
        row = row_from(sweep, head_name, "auto", 0, 0, sweep.plain)
    row.predicted_speedup = choice.speedup
    print(f"  auto for {head_name} T={sweep.config.sampling.temperature}: budget {choice.budget}, depth "
          f"{choice.depth}, predicted x{choice.speedup:.2f}, measured x{row.speedup:.2f}", flush=True)
    return row


def prompt_lookup_row(sweep: Sweep) -> Row:
    """Hugging Face's prompt-lookup decoding, batch 1, on the same prompts and budget."""
    lookup = hf_generate(sweep.loaded, sweep.prompts, sweep.config, lookup=PROMPT_LOOKUP_TOKENS)
    return Row(head="-", temperature=sweep.config.sampling.temperature, method="prompt_lookup",
               budget=PROMPT_LOOKUP_TOKENS, depth=0, accept_length=math.nan,
               tokens_per_second=lookup.tokens_per_second,
               speedup=lookup.tokens_per_second / sweep.plain.tokens_per_second, mean_tree_nodes=0, steps=0,
               draft_seconds=0, verify_seconds=0, total_seconds=lookup.seconds,
               identical=lookup.identical_to(sweep.plain, sweep.config), near_ties=0)


def draft_vocab_timing(loaded: LoadedModel, head: MTPHead) -> dict[str, float]:
    """One draft level (4 children, 200-token prefix) over the head's reduced draft vocabulary and over the full
    vocabulary: what ``--draft-vocab`` buys per level."""
    prompt = torch.randint(loaded.model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    hidden = TransformersRunner(loaded.model).prefill(prompt).hidden
    reduced = time_draft_level(head, hidden, prompt, repeats=9)
    saved = head.draft_vocab
    try:
        head.draft_vocab = None
        head.refresh_draft_head()
        full = time_draft_level(head, hidden, prompt, repeats=9)
    finally:
        head.draft_vocab = saved
        head.refresh_draft_head()
    return {"draft_vocab_size": head.draft_vocab_size, "vocab_size": head.vocab_size,
            "draft_level_seconds": reduced, "full_vocab_draft_level_seconds": full}


def row_from(sweep: Sweep, head: str, method: str, budget: int, depth: int, output: GenerationOutput,
             identical: bool | None = None, near_ties: int = 0) -> Row:
    stats = output.stats
    return Row(head=head, temperature=sweep.config.sampling.temperature, method=method, budget=budget, depth=depth,
               accept_length=output.accept_length_mean, tokens_per_second=output.tokens_per_second,
               speedup=output.tokens_per_second / sweep.plain.tokens_per_second, mean_tree_nodes=0.0,
               steps=stats.steps, draft_seconds=stats.draft_seconds, verify_seconds=stats.verify_seconds,
               total_seconds=stats.total_seconds, identical=identical, near_ties=near_ties)


def finish_row(sweep: Sweep, head_name: str, policy: TreePolicy, output: GenerationOutput,
               profile: AcceptanceProfile) -> Row:
    identical, near_ties = greedy_identity(output, sweep.plain) if sweep.config.sampling.greedy else (None, 0)
    row = row_from(sweep, head_name, policy.name, policy.budget, policy.depth, output, identical, near_ties)
    nodes = min(policy.budget, policy.depth) + 1 if policy.name == "chain" else policy.budget + 1
    row.mean_tree_nodes = nodes
    row.predicted_speedup = predicted_speedup(sweep.costs, row.accept_length, nodes, policy.depth)
    if policy.name == "sequoia":
        row.predicted_accept_length, row.profile_predicted_speedup = profile_prediction(
            profile, sweep.costs, policy.budget, policy.depth)
    return row


def profile_prediction(profile: AcceptanceProfile, costs: CostCurve, budget: int, depth: int) -> tuple[float, float]:
    """(F(T), predicted speedup) of the Sequoia tree for (budget, depth) under the profile: what ``--auto``
    predicts for the same tree, costs and profile."""
    accept_length = sequoia_plan(profile, budget, depth).expected_accept_length
    return accept_length, predicted_speedup(costs, accept_length, budget + 1, depth)


def prediction_fit(rows: list[Row]) -> dict[str, Any]:
    """How well accept length / cost predicts the measured speedup (Pearson r, mean absolute error)."""
    pairs = [(r.predicted_speedup, r.speedup) for r in rows
             if r.predicted_speedup is not None and r.method not in ("plain", "prompt_lookup", "auto")]
    if len(pairs) < 2:
        return {}
    predicted, measured = zip(*pairs)
    mean_p, mean_m = sum(predicted) / len(pairs), sum(measured) / len(pairs)
    cov = sum((p - mean_p) * (m - mean_m) for p, m in pairs)
    var_p = sum((p - mean_p) ** 2 for p in predicted)
    var_m = sum((m - mean_m) ** 2 for m in measured)
    r = cov / math.sqrt(var_p * var_m) if var_p > 0 and var_m > 0 else float("nan")
    sequoia = [(row.predicted_accept_length, row.accept_length) for row in rows
               if row.predicted_accept_length is not None]
    ratios = [measured / predicted for predicted, measured in sequoia]
    return {
        "pearson_r": r,
        "mean_abs_error": sum(abs(p - m) for p, m in pairs) / len(pairs),
        "points": len(pairs),
        "sequoia_measured_over_predicted_accept_length": {
            "min": min(ratios), "max": max(ratios), "mean": sum(ratios) / len(ratios)} if ratios else {},
    }


def render_markdown(report: dict[str, Any]) -> str:
    rows = report["rows"]
    lines = [f"# Acceptance sweep ({report['environment']['device']}, {report['environment']['model']})", "",
             f"Command: `{report['command']}`", "",
             "Accept length = tokens per step, bonus included. Speedup = tokens/s over plain decoding in the same run.",
             ""]
    lines += markdown_table(
        ["head", "T", "method", "budget", "depth", "accept length", "tok/s", "speedup", "predicted", "identical"],
        [[row["head"], row["temperature"], row["method"], row["budget"], row["depth"],
          accept_cell(row["accept_length"]), f"{row['tokens_per_second']:.1f}", f"{row['speedup']:.2f}",
          "" if row["predicted_speedup"] is None else f"{row['predicted_speedup']:.2f}",
          identical_cell(row["identical"])] for row in rows])
    costs = report["costs"]
    lines += ["", "Verify cost (target forward over n tree tokens after a "
              f"{costs['prefix']}-token prefix, ms): "
              + ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in sorted((int(k), v) for k, v in costs["verify"].items())),
              f"; one draft level {costs['draft_level'] * 1e3:.1f} ms; host overhead per step "
              f"{costs['step_overhead'] * 1e3:.1f} ms."]
    if report["head_quality"]:
        trees = [key for key in next(iter(report["head_quality"].values()))
                 if key.endswith("_accept_length") and not key.startswith("chain")]
        lines.append("")
        lines += markdown_table(
            ["head", "depth-1 top-1", "top-4", "top-8", "chain-4 AL",
             *(key.replace("_accept_length", "") for key in trees)],
            [[name, f"{quality['depth1_top1']:.3f}", f"{quality['depth1_top4']:.3f}", f"{quality['depth1_top8']:.3f}",
              f"{quality['chain4_accept_length']:.2f}", *(f"{quality[key]:.2f}" for key in trees)]
             for name, quality in report["head_quality"].items()])
    for name, timing in report.get("draft_vocabulary", {}).items():
        lines.append(f"Head {name}: one draft level {timing['draft_level_seconds'] * 1e3:.1f} ms over its "
                     f"{timing['draft_vocab_size']}-token draft vocabulary, "
                     f"{timing['full_vocab_draft_level_seconds'] * 1e3:.1f} ms over all {timing['vocab_size']}.")
    if report["prediction"]:
        fit = report["prediction"]
        lines += ["", f"Predicted vs measured speedup: Pearson r = {fit['pearson_r']:.3f}, mean absolute error "
                      f"{fit['mean_abs_error']:.3f} over {fit['points']} configurations."]
        ratio = fit.get("sequoia_measured_over_predicted_accept_length")
        if ratio:
            lines.append(f"Sequoia trees, measured / profile-predicted accept length: mean {ratio['mean']:.3f} "
                         f"(min {ratio['min']:.3f}, max {ratio['max']:.3f}).")
    return "\n".join(lines) + "\n"


def draw_plots(report: dict[str, Any], folder: Path, stem: str) -> None:
    import matplotlib  # the optional `bench` extra: only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    temperatures = sorted({row["temperature"] for row in rows})
    heads = sorted({row["head"] for row in rows if row["head"] != "-"})
    policies = ["chain", "eagle", "sequoia", "specexec"]
    for metric, label in (("accept_length", "accept length (tokens/step)"), ("speedup", "speedup over plain")):
        figure, axes = plt.subplots(len(heads), len(temperatures), figsize=(6 * len(temperatures), 4 * len(heads)),
                                    squeeze=False)
        for i, head in enumerate(heads):
            for j, temperature in enumerate(temperatures):
                axis = axes[i][j]
                for policy in policies:
                    points = sorted((r["budget"], r[metric]) for r in rows if r["head"] == head and
                                    r["temperature"] == temperature and r["method"] == policy and r["depth"] ==
                                    max(rr["depth"] for rr in rows if rr["method"] == policy and rr["head"] == head))
                    if points:
                        axis.plot(*zip(*points), marker="o", label=policy)
                if metric == "speedup":
                    axis.axhline(1.0, color="grey", linestyle="--", linewidth=1)
                    lookup = [r["speedup"] for r in rows
                              if r["method"] == "prompt_lookup" and r["temperature"] == temperature]
                    if lookup:
                        axis.axhline(lookup[0], color="black", linestyle=":", label="HF prompt lookup")
                axis.set_xscale("log", base=2)
                axis.set_xlabel("budget (draft nodes)")
                axis.set_ylabel(label)
                axis.set_title(f"head {head}, temperature {temperature}")
                axis.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(folder / f"{stem}-{metric.replace('_', '-')}.png", dpi=110)
        plt.close(figure)
    costs = report["costs"]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = sorted(int(k) for k in costs["verify"])
    axes[0].plot(sizes, [costs["verify"][str(n)] * 1e3 for n in sizes], marker="o")
    axes[0].set_xlabel("tree tokens verified (root included)")
    axes[0].set_ylabel("target forward (ms)")
    axes[0].set_title(f"verify cost, {costs['device']}")
    pairs = [(r["predicted_speedup"], r["speedup"], r["method"]) for r in rows
             if r["predicted_speedup"] is not None and r["method"] in policies]
    for policy in policies:
        points = [(p, m) for p, m, name in pairs if name == policy]
        if points:
            axes[1].scatter(*zip(*points), label=policy, s=18)
    if pairs:
        low = min(min(p, m) for p, m, _ in pairs)
        high = max(max(p, m) for p, m, _ in pairs)
        axes[1].plot([low, high], [low, high], color="grey", linestyle="--", linewidth=1)
    axes[1].set_xlabel("predicted speedup (accept length / cost)")
    axes[1].set_ylabel("measured speedup")
    axes[1].set_title("does accept length / cost predict the speedup?")
    axes[1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(folder / f"{stem}-costs.png", dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(exit_status(main))
