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
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--heads", default=None,
                        help="name=PATH,... (default: the shipped generic and code heads of the model)")
    parser.add_argument("--profiles", default=None,
                        help="name@temperature=PATH,... acceptance profiles per head (default: shipped ones)")
    parser.add_argument("--prompts", default="humaneval:120-163")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--policies", default="chain,eagle,sequoia,specexec")
    parser.add_argument("--budgets", default="4,8,16,32,64")
    parser.add_argument("--depths", default="3,6")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--tree-sizes", default="16,32,168", help="tree budgets for the head-quality table")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "acceptance.json")
    parser.add_argument("--quick", action="store_true", help="tiny-deepseek and a few configurations")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


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
    predicted_speedup: float | None = None
    predicted_accept_length: float | None = None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.model, args.prompts, args.num_prompts, args.max_new_tokens = "tiny-deepseek", "toy", 4, 24
        args.budgets, args.depths, args.temperatures, args.tree_sizes = "4,8", "3", "0,0.7", "8"
    import torch

    from sglang_spec.decode.autotune import choose_speculation, measure_costs
    from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder, compare_with_plain, generate_plain
    from sglang_spec.models.registry import load_model
    from sglang_spec.sampling import SamplingParams
    from sglang_spec.tree.policies import TreePolicy

    torch.manual_seed(args.seed)
    loaded = load_model(args.model)
    heads = load_heads(loaded, args.heads)
    prompts, prompt_ids = load_prompt_tokens(loaded, args.prompts, args.num_prompts, args.seed)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    profiles = load_profiles(loaded, heads, args.profiles, temperatures)
    first_head = next(iter(heads.values()))
    print(f"measuring the verify-cost curve on {platform.processor() or 'this machine'} ...", flush=True)
    sizes = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
    # per temperature: sampled verification costs more per step than greedy
    costs_by_temperature = {t: measure_costs(loaded.model, first_head, sizes=sizes,
                                             sampling=SamplingParams(temperature=t)) for t in temperatures}
    draft_vocabulary = {name: draft_vocab_timing(loaded, head) for name, head in heads.items()}
    rows: list[Row] = []
    quality = {}
    total_runs = len(heads) * len(temperatures) * (len(args.policies.split(",")) * len(args.budgets.split(","))
                                                     * len(args.depths.split(",")))
    done = 0
    start_time = time.perf_counter()
    for temperature in temperatures:
        sampling = SamplingParams(temperature=temperature)
        costs = costs_by_temperature[temperature]
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                                  eos_token_ids=loaded.eos_token_ids)
        plain = run_plain(loaded, prompts, config)
        plain_row = row_from("-", temperature, "plain", 0, 0, plain, plain.tokens_per_second, None, 0)
        rows.append(plain_row)
        lookup = run_prompt_lookup(loaded, prompts, config)
        rows.append(Row("-", temperature, "prompt_lookup", 10, 0, math.nan, lookup["tokens_per_second"],
                        lookup["tokens_per_second"] / plain.tokens_per_second, 0, 0, 0, 0, lookup["seconds"],
                        lookup["identical"], 0))
        for head_name, head in heads.items():
            profile = profiles[(head_name, temperature)]
            seen: set[tuple[str, int, int]] = set()
            for policy_name in args.policies.split(","):
                for budget in [int(b) for b in args.budgets.split(",")]:
                    for depth in [int(d) for d in args.depths.split(",")]:
                        done += 1
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
                        output = one_by_one(SpeculativeDecoder(loaded.model, head, policy), prompts, config)
                        rows.append(finish_row(head_name, temperature, policy, output, plain, costs, profile,
                                               compare_with_plain))
                        print(f"[{done}/{total_runs} {elapsed(start_time)}] {head_name} T={temperature} "
                              f"{policy_name:>8} b={budget:<3} d={depth}: AL {rows[-1].accept_length:.2f}, "
                              f"{rows[-1].tokens_per_second:.1f} tok/s, x{rows[-1].speedup:.2f}"
                              + ("" if rows[-1].identical in (None, True) else "  NOT IDENTICAL"), flush=True)
            choice = choose_speculation(profile, costs, max_depth=8)
            if choice.budget > 0:
                policy = TreePolicy("sequoia", budget=choice.budget, depth=choice.depth, profile=profile)
                output = one_by_one(SpeculativeDecoder(loaded.model, head, policy), prompts, config)
                auto_row = finish_row(head_name, temperature, policy, output, plain, costs, profile, compare_with_plain)
                auto_row.method = "auto"
            else:
                auto_row = row_from(head_name, temperature, "auto", 0, 0, plain, plain.tokens_per_second, None, 0)
            auto_row.predicted_speedup = choice.speedup
            rows.append(auto_row)
            print(f"  auto for {head_name} T={temperature}: budget {choice.budget}, depth {choice.depth}, "
                  f"predicted x{choice.speedup:.2f}, measured x{auto_row.speedup:.2f}", flush=True)
            if temperature == 0:
                quality[head_name] = head_quality(loaded, head, prompts, plain, costs, profile, args, config)
    report = {
        "environment": environment(loaded),
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    markdown = args.out.with_suffix(".md")
    markdown.write_text(render_markdown(report))
    draw_plots(report, args.out.parent, args.out.stem)
    print(render_markdown(report))
    print(f"wrote {args.out}, {markdown} and plots in {args.out.parent}")
    return 0


def elapsed(start: float) -> str:
    minutes = (time.perf_counter() - start) / 60
    return f"{minutes:.0f} min"


def load_heads(loaded, spec: str | None) -> dict:
    from sglang_spec.models.registry import load_head_for, shipped_head_path

    if spec:
        return {name: load_head_for(loaded, path) for name, path in (item.split("=", 1) for item in spec.split(","))}
    if loaded.name == "smollm2":
        generic = shipped_head_path("smollm2-generic")
        heads = {}
        if generic is not None:
            heads["generic"] = load_head_for(loaded, generic)
        heads["code"] = load_head_for(loaded, None)
        return heads
    return {"default": load_head_for(loaded, None)}


def load_profiles(loaded, heads: dict, spec: str | None, temperatures: list[float]) -> dict:
    """(head, temperature) -> profile: given ones, else shipped ones, else calibrated on the fly (tiny models)."""
    from sglang_spec.models.registry import shipped_profile_path
    from sglang_spec.tree.profile import AcceptanceProfile

    given = {}
    if spec:
        for item in spec.split(","):
            key, path = item.split("=", 1)
            name, temperature = key.split("@")
            given[(name, float(temperature))] = AcceptanceProfile.from_json(path)
    result = {}
    for name in heads:
        for temperature in temperatures:
            if (name, temperature) in given:
                result[(name, temperature)] = given[(name, temperature)]
                continue
            label = loaded.name if name in ("code", "default") else f"{loaded.name}-{name}"
            path = shipped_profile_path(label, temperature)
            if path is not None:
                result[(name, temperature)] = AcceptanceProfile.from_json(path)
            else:
                result[(name, temperature)] = AcceptanceProfile.uniform([0.6, 0.2, 0.1, 0.05])
                print(f"  no profile for head {name} at T={temperature}: using a generic one")
    return result


def load_prompt_tokens(loaded, spec: str, count: int, seed: int):
    if spec == "toy":
        from sglang_spec.models.toy_language import ToyLanguage

        language = ToyLanguage(loaded.model.config.vocab_size, seed=123 + seed)
        prompts = [language.sample(1, 8)[0].tolist() for _ in range(count)]
        return prompts, [f"toy/{i}" for i in range(count)]
    from sglang_spec.train.generate_traffic import prompt_tokens
    from sglang_spec.train.prompts import load_prompts

    specs = load_prompts(spec)[:count]
    return [prompt_tokens(loaded, s) for s in specs], [s.id for s in specs]


def one_by_one(decoder, prompts, config):
    """Batch 1, one request after another, exactly as plain decoding runs: tokens/s are comparable."""
    from dataclasses import fields

    from sglang_spec.decode.decoder import GenerationOutput, GenerationStats

    outputs = [decoder.generate([prompt], config) for prompt in prompts]
    stats = GenerationStats(**{f.name: sum(getattr(o.stats, f.name) for o in outputs) for f in fields(GenerationStats)})
    return GenerationOutput([output.requests[0] for output in outputs], stats)


def run_plain(loaded, prompts, config):
    from sglang_spec.decode.decoder import generate_plain

    return generate_plain(loaded.model, prompts, config)


def run_prompt_lookup(loaded, prompts, config) -> dict:
    """Hugging Face's prompt-lookup decoding (n-gram drafts from the prompt), batch 1, same prompts and budget."""
    import torch

    start = time.perf_counter()
    generated = 0
    identical = True if config.sampling.greedy else None
    reference = None
    if config.sampling.greedy:
        from sglang_spec.decode.decoder import generate_plain

        reference = generate_plain(loaded.model, prompts, config)
        start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        kwargs = dict(max_new_tokens=config.max_new_tokens, prompt_lookup_num_tokens=10,
                      eos_token_id=list(config.eos_token_ids) or None, pad_token_id=0)
        if config.sampling.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=config.sampling.temperature, top_k=0, top_p=1.0)
        with torch.no_grad():
            output = loaded.model.generate(input_ids=torch.tensor([prompt]), **kwargs)
        tokens = output[0, len(prompt):].tolist()
        generated += len(tokens)
        if reference is not None and tokens != reference.requests[index].tokens:
            identical = False
    seconds = time.perf_counter() - start
    return {"tokens_per_second": generated / seconds, "seconds": seconds, "identical": identical}


def draft_vocab_timing(loaded, head) -> dict:
    """One draft level (4 children, 200-token prefix) over the head's reduced draft vocabulary and over the full
    vocabulary: what ``--draft-vocab`` buys per level."""
    import torch

    from sglang_spec.decode.autotune import time_draft_level
    from sglang_spec.decode.target import TargetRunner

    prompt = torch.randint(loaded.model.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    hidden = TargetRunner(loaded.model).prefill(prompt).hidden
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


def row_from(head, temperature, method, budget, depth, output, plain_tps, identical, near_ties) -> Row:
    stats = output.stats
    return Row(head, temperature, method, budget, depth, output.accept_length_mean, output.tokens_per_second,
               output.tokens_per_second / plain_tps, 0.0, stats.steps, stats.draft_seconds, stats.verify_seconds,
               stats.total_seconds, identical, near_ties)


def finish_row(head_name, temperature, policy, output, plain, costs, profile, compare) -> Row:
    identical, near_ties = None, 0
    if temperature == 0:
        comparisons = [compare(ours, theirs) for ours, theirs in zip(output.requests, plain.requests)]
        identical = all(c.identical or c.excused for c in comparisons)
        near_ties = sum(c.excused for c in comparisons)
    row = row_from(head_name, temperature, policy.name, policy.budget, policy.depth, output, plain.tokens_per_second,
                   identical, near_ties)
    nodes = min(policy.budget, policy.depth) + 1 if policy.name == "chain" else policy.budget + 1
    row.mean_tree_nodes = nodes
    row.predicted_speedup = predict_speedup(row.accept_length, nodes, policy.depth, costs)
    if policy.name == "sequoia":
        from sglang_spec.tree.sequoia import sequoia_plan

        row.predicted_accept_length = sequoia_plan(profile, policy.budget, policy.depth).expected_accept_length
    return row


def predict_speedup(accept_length: float, nodes: int, depth: int, costs) -> float:
    """plain decoding's time per token * accept length / (verify(nodes) + depth draft levels + the commit forward
    + host overhead)."""
    sizes = sorted(costs.verify)
    verify = interpolate(costs.verify, nodes) if nodes <= sizes[-1] else costs.verify[sizes[-1]] * nodes / sizes[-1]
    step = verify + (depth + 1) * costs.draft_level + costs.step_overhead
    return costs.baseline_token * accept_length / step


def interpolate(points: dict, x: float) -> float:
    keys = sorted(points)
    for low, high in zip(keys, keys[1:]):
        if low <= x <= high:
            return points[low] + (points[high] - points[low]) * (x - low) / (high - low)
    return points[keys[0]] if x < keys[0] else points[keys[-1]]


def head_quality(loaded, head, prompts, plain, costs, profile, args, config) -> dict:
    """The issue's baseline metrics for one head on the held-out prompts (temperature 0): depth-1 top-1/4/8
    acceptance (calibrated on plain decoding's own completions), chain-4 accept length and tree accept lengths."""
    from sglang_spec.decode.decoder import SpeculativeDecoder
    from sglang_spec.train.calibrate import calibrate
    from sglang_spec.train.traffic import TrafficRecord
    from sglang_spec.tree.policies import TreePolicy

    records = [
        TrafficRecord(f"heldout/{i}/greedy", "code", loaded.decode(request.tokens), prompt=loaded.decode(prompt))
        for i, (prompt, request) in enumerate(zip(prompts, plain.requests))
    ]
    calibration = calibrate(loaded, head, records, depth=4, max_rank=8, temperature=0.0, progress=False)
    depth_one = calibration.profile.row(1)
    result = {
        "depth1_top1": depth_one[0],
        "depth1_top4": sum(depth_one[:4]),
        "depth1_top8": sum(depth_one[:8]),
        "depth_top1": calibration.top1,
    }
    chain = SpeculativeDecoder(loaded.model, head, TreePolicy("chain", 4, 4)).generate(prompts, config)
    result["chain4_accept_length"] = chain.accept_length_mean
    for size in [int(s) for s in args.tree_sizes.split(",")]:
        for name in ("sequoia", "specexec"):
            depth = 6 if size > 16 else 4
            policy = TreePolicy(name, budget=size, depth=depth, profile=profile, topk=8)
            output = SpeculativeDecoder(loaded.model, head, policy).generate(prompts, config)
            result[f"{name}{size}_accept_length"] = output.accept_length_mean
    return result


def prediction_fit(rows: list[Row]) -> dict:
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


def render_markdown(report: dict) -> str:
    rows = report["rows"]
    lines = [f"# Acceptance sweep ({report['environment']['device']}, {report['environment']['model']})", "",
             f"Command: `{report['command']}`", "",
             "Accept length = tokens per step, bonus included. Speedup = tokens/s over plain decoding in the same run.",
             "", "| head | T | method | budget | depth | accept length | tok/s | speedup | predicted | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        predicted = "" if row["predicted_speedup"] is None else f"{row['predicted_speedup']:.2f}"
        identical = {None: "", True: "yes", False: "NO"}[row["identical"]]
        accept = "" if row["accept_length"] != row["accept_length"] else f"{row['accept_length']:.2f}"
        lines.append(f"| {row['head']} | {row['temperature']} | {row['method']} | {row['budget']} | {row['depth']} | "
                     f"{accept} | {row['tokens_per_second']:.1f} | {row['speedup']:.2f} | {predicted} | {identical} |")
    costs = report["costs"]
    lines += ["", "Verify cost (target forward over n tree tokens after a "
              f"{costs['prefix']}-token prefix, ms): "
              + ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in sorted((int(k), v) for k, v in costs["verify"].items())),
              f"; one draft level {costs['draft_level'] * 1e3:.1f} ms; host overhead per step "
              f"{costs['step_overhead'] * 1e3:.1f} ms."]
    if report["head_quality"]:
        lines += ["", "| head | depth-1 top-1 | top-4 | top-8 | chain-4 AL | " + " | ".join(
            key.replace("_accept_length", "") for key in next(iter(report["head_quality"].values()))
            if key.endswith("_accept_length") and not key.startswith("chain")) + " |"]
        lines.append("|" + "---|" * (5 + sum(1 for k in next(iter(report["head_quality"].values()))
                                            if k.endswith("_accept_length") and not k.startswith("chain"))))
        for name, quality in report["head_quality"].items():
            trees = [f"{v:.2f}" for k, v in quality.items() if k.endswith("_accept_length") and not k.startswith("chain")]
            lines.append(f"| {name} | {quality['depth1_top1']:.3f} | {quality['depth1_top4']:.3f} | "
                         f"{quality['depth1_top8']:.3f} | {quality['chain4_accept_length']:.2f} | " + " | ".join(trees) + " |")
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


def draw_plots(report: dict, folder: Path, stem: str) -> None:
    import matplotlib

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
                    lookup = [r["speedup"] for r in rows if r["method"] == "prompt_lookup" and r["temperature"] == temperature]
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


def environment(loaded) -> dict:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = None
    return {"device": f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads, CPU",
            "model": loaded.name, "dtype": str(next(loaded.model.parameters()).dtype), "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit}


if __name__ == "__main__":
    sys.exit(main())
