"""The results page, ``docs/results/README.md``, written from the benchmarks' own JSON files in ``docs/results/``,
and the headline table of the repository's ``README.md`` (between its ``results:begin`` / ``results:end`` markers).

    python bench/report.py            # rewrite both
    python bench/report.py --check    # exit 1, naming what is stale, if either differs from what the JSON gives

Each benchmark keeps one file set with a stable name (``serving_sweep_c1.json`` / ``.csv`` / ``.png``,
``hybrid.json``, ...). Per benchmark the page gives the run's table, its plot, the machine and the command, taken
from the JSON (``command``, ``environment``); for a JSON that carries neither (``bench/serving_sweep.py`` writes
rows only) from ``recorded_runs.json``, recorded by hand with the run; where neither has it the page says "not
recorded". GPU checks (``scripts/gpu_check.sh``) are filed under ``gpu/`` (the results JSON beside the console
logs); the page gives the latest result of every check on every device.

Standard library only, so ``tests/docs/test_results_page.py`` regenerates the page in a second.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
PAGE = RESULTS / "README.md"
README = REPO / "README.md"
RECORDED = "recorded_runs.json"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NOT_RECORDED = "not recorded"

# ------------------------------------------------------------------------------------------------ reading


def load(results: Path, name: str) -> Any:
    return json.loads((results / name).read_text())


def recorded(results: Path, name: str) -> dict[str, str]:
    """What ``recorded_runs.json`` says about ``name`` (command, machine), or nothing."""
    path = results / RECORDED
    return json.loads(path.read_text()).get(name, {}) if path.exists() else {}


ENVIRONMENT_KEYS = ("device", "model", "dtype", "threads", "torch", "cuda", "triton", "python", "sglang")


def machine(data: Any, results: Path, name: str) -> str:
    """The machine a run measured on, from its ``environment`` (never its commit or date)."""
    env = data.get("environment") if isinstance(data, dict) else None
    if not env:
        return recorded(results, name).get("machine", NOT_RECORDED)
    parts = []
    for key in ENVIRONMENT_KEYS:
        if key not in env:
            continue
        value = env[key]
        if key == "sglang":
            parts.append("no sglang" if value is None else f"sglang {value}")
        elif key == "dtype":
            parts.append(str(value).replace("torch.", ""))
        elif key == "threads":
            parts.append(f"{value} threads")
        elif key in ("torch", "cuda", "triton", "python"):
            parts.append(f"{key} {value}")
        else:
            parts.append(str(value))
    return ", ".join(parts)


def command(data: Any, results: Path, name: str) -> str:
    given = data.get("command") if isinstance(data, dict) else None
    return given or recorded(results, name).get("command", NOT_RECORDED)


# ------------------------------------------------------------------------------------------------ formatting


def table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def f2(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def f1(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def run_lines(data: Any, results: Path, name: str, files: list[str]) -> str:
    """Machine, command and the run's files (each a link)."""
    links = ", ".join(f"[{file}]({file})" for file in files if (results / file).exists())
    return "\n".join([f"* Machine: {machine(data, results, name)}",
                      f"* Command: `{command(data, results, name)}`",
                      f"* Files: {links}"])


class Section:
    """One heading of the page: its title, the files it reads, and its body."""

    def __init__(self, title: str, files: list[str], body: Callable[[Path], str]) -> None:
        self.title, self.files, self.body = title, files, body

    @property
    def anchor(self) -> str:
        return slug(self.title)


# ------------------------------------------------------------------------------------------------ serving


SERVING_LABELS = {"plain": "plain decoding", "plain-sync": "plain decoding, overlap loop off",
                  "auto": "hybrid + `--speculative-tree-auto`",
                  "auto-batch": "the same planner, whole batch on or off (`--speculative-tree-verify-sizes 1,N`)",
                  "auto-sync": "hybrid + `--speculative-tree-auto`, overlap loop off",
                  "auto-batch-sync": "the same planner, whole batch on or off, overlap loop off",
                  "sglang-tree": "SGLang's EAGLE tree (topk 4)",
                  "sglang-ngram": "SGLang's NGRAM", "sglang-chain": "SGLang's EAGLE chain"}

LOCKSTEP = ("Every request asks the same number of tokens, so plain decoding's requests finish together and the "
            "next ones are prefilled before their first token; a speculating server's finish apart, and the later "
            "prefills land between the running requests' chunks. Those prefills are its p99 ITL: the planned "
            "steps (`--plan-logs`) are far shorter.")
SPREAD = ("Each request asks its own number of tokens, spread around the mean (`--output-len-spread`): every "
          "server's requests end apart, so prompts are prefilled between running requests' chunks under plain "
          "decoding too, and p99 ITL compares the methods, not where their prefills fall.")


def command_option(data: Any, flag: str) -> str | None:
    """The value the JSON's recorded ``command`` gives ``flag`` (the bed's ``option_value``: ``--flag value`` or
    ``--flag=value``, the last one winning); None when absent or when the JSON records no command."""
    from sglang_spec_testbed.server import option_value  # imports torch: only for the pages that ask

    return option_value(shlex.split(data.get("command", "")) if isinstance(data, dict) else [], flag)


SERVING_ABOUT = {
    "serving_sweep_c1.json": "One request at a time: tree auto (hybrid trees of 11 draft tokens, or a plain step "
                             "where a tree does not pay) against plain decoding, with and without SGLang's overlap "
                             "loop, and against SGLang's own EAGLE tree and NGRAM, all servers up together.",
    "serving_sweep_c16.json": "Sixteen concurrent requests of code, extraction, chat and a mixed stream of the "
                              "three: the same servers under load, where a full tree step costs more than it "
                              "gives and the per-step planner is meant to take a plain step or a small tree.",
    "serving_sweep_mixed_c4.json": "Four concurrent requests of code, of extraction and of a mixed stream (code, "
                                   "extraction and chat requests arriving together): the per-step planner (each "
                                   "request its own share of the step's draft nodes, from every request's "
                                   "predicted reach, verified ragged: a request's forward covers its own tree) "
                                   "against the same planner choosing only a plain step or the full tree for the "
                                   "whole batch, and against SGLang's own EAGLE tree and NGRAM, all servers up "
                                   "together.",
    "serving_sweep_tp2_c1.json": "One request at a time, the model split over two ranks: SmolLM2 with zero "
                                 "attention heads appended (`--cpu-model smollm2-split`: 12 query / 4 KV heads, the "
                                 "same outputs; its draft proposes over the whole vocabulary, as R1's MTP layer "
                                 "does) served at `--tp-size 1` and `--tp-size 2` (two scheduler ranks over gloo, a "
                                 "core each), tree auto and plain decoding at each size, all servers up together. "
                                 "Each ratio is over plain decoding at the same size: whether the planner's gain "
                                 "holds when the model is split.",
    "serving_sweep_peers.json": "One request at a time, 15 draft tokens each: the project's hybrid trees against "
                                "SGLang's own EAGLE tree (topk 4, 4 steps) and NGRAM drafting, as a user would "
                                "launch them.",
}
SERVING_TITLES = {"serving_sweep_c1.json": "Serving, one request: tree auto against plain decoding",
                  "serving_sweep_c16.json": "Serving, 16 requests: tree auto against plain decoding",
                  "serving_sweep_mixed_c4.json": "Serving, 4 requests: per-step plans against a plain-or-full "
                                                 "switch and SGLang's own speculation",
                  "serving_sweep_tp2_c1.json": "Serving, one request, split over two ranks: tree auto at TP 1 "
                                               "and TP 2",
                  "serving_sweep_peers.json": "Serving, accept length against SGLang's own speculation"}
SERVING_NOTE = ("SmolLM2-135M-Instruct and its shipped MTP head served by SGLang's `launch_server` on the CPU test "
                "bed, SGLang's `bench_serving` client, greedy, on prompts no head was trained on (code: held-out "
                "HumanEval tasks; extraction: copy-out questions over passages of a long report; chat: "
                "`bench/workloads/serving/chat.jsonl`). The trees' budget was chosen on the reference bench's own "
                "prompts, hybrid's 3 head levels on these workloads; SGLang's trees and NGRAM keep their defaults. "
                "Tokens/s and latencies are medians over the rounds; "
                "x plain = output tokens/s over the faster plain server's; per round = each round's ratio over "
                "that round's faster plain (lowest to highest). Accept length = tokens a verify step emits, the "
                "bonus token included.")


def serving_files(results: Path) -> list[str]:
    known = [name for name in SERVING_TITLES if (results / name).exists()]
    others = sorted(path.name for path in results.glob("serving_sweep*.json") if path.name not in SERVING_TITLES)
    return known + others


def serving_body(name: str) -> Callable[[Path], str]:
    def body(results: Path) -> str:
        data = load(results, name)
        rows = data["rows"] if isinstance(data, dict) else data  # older runs filed the rows alone
        tpot = any(row.get("p99_tpot_ms") is not None for row in rows)  # older runs did not record it
        out = []
        for row in rows:
            rounds = row.get("speedup_over_plain_rounds") or []
            spread = f"{min(rounds):.2f}-{max(rounds):.2f}x" if len(rounds) > 1 else ""
            label = SERVING_LABELS.get(row["policy"], row["policy"]) + _tp(row)
            out.append([row.get("workload", ""), label, row["budget"], row["concurrency"],
                        f2(row["output_throughput"]), x(row.get("speedup_over_plain")), spread,
                        f2(row["accept_length"]), f1(row.get("median_itl_ms")), f1(row.get("p99_itl_ms"))]
                       + ([f1(row.get("p99_tpot_ms"))] if tpot else []))
        stem = name[:-len(".json")]
        rounds = max((len(row.get("output_throughput_rounds") or []) for row in rows), default=0)
        closed_loop = max(int(value) for value in (command_option(data, "--concurrency") or "1").split(",")) > 1
        lengths = (" " + (SPREAD if command_option(data, "--output-len-spread") else LOCKSTEP)) if closed_loop else ""
        loop = (" The planner's servers marked \"overlap loop off\" run as the plain one so marked "
                "(`--disable-overlap-schedule`): on this CPU SGLang's overlap loop competes with the forward for "
                "the two cores.") if _loop(rows) else ""
        return "\n\n".join([
            SERVING_ABOUT.get(name, "A run of the serving sweep.") + lengths + loop
            + (f" {rounds} rounds." if rounds > 1 else " One round."),
            run_lines(data, results, name, [name, f"{stem}.csv", f"{stem}.png"]),
            table(["workload", "method", "draft tokens", "concurrency", "output tok/s", "x plain", "per round",
                   "accept length", "p50 ITL ms", "p99 ITL ms", *(["p99 TPOT ms"] if tpot else [])], out),
            *_tp_comparison(rows),
        ])

    return body


def _tp(row: dict[str, Any]) -> str:
    """A row's tensor-parallel size as its label says it: nothing at 1."""
    return f", TP {row['tp_size']}" if row.get("tp_size", 1) > 1 else ""


def tp_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and speculating method of a sweep over several tensor-parallel sizes: its ratio over plain
    decoding at each size, and the largest size's ratio over the smallest's (1.0: the gain holds when split)."""
    sizes = sorted({row.get("tp_size", 1) for row in rows})
    found = []
    for workload in _workloads(rows):
        for policy in dict.fromkeys(row["policy"] for row in rows if not row["policy"].startswith("plain")):
            ratios = {row.get("tp_size", 1): row["speedup_over_plain"] for row in rows
                      if row["workload"] == workload and row["policy"] == policy}
            if len(sizes) > 1 and all(ratios.get(size) for size in sizes):
                found.append({"workload": workload, "policy": policy, "ratios": ratios,
                              "held": ratios[sizes[-1]] / ratios[sizes[0]]})
    return found


def _tp_comparison(rows: list[dict[str, Any]]) -> list[str]:
    """The TP comparison table of a sweep over several sizes (none otherwise)."""
    found = tp_ratios(rows)
    if not found:
        return []
    sizes = sorted(found[0]["ratios"])
    return [table(["workload", "method", *(f"x plain, TP {size}" for size in sizes),
                   f"TP {sizes[-1]} over TP {sizes[0]}"],
                  [[item["workload"], SERVING_LABELS.get(item["policy"], item["policy"]),
                    *(x(item["ratios"][size]) for size in sizes), f2(item["held"])] for item in found])]


def sglang_trees_body(results: Path) -> str:
    name = "sglang_trees.json"
    data = load(results, name)
    rows = data["rows"]
    budgets = sorted({row["budget"] for row in rows})
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    cells = {(row["budget"], row["policy"]): f"{row['accept_length']:.2f} (W {row['width']})" for row in rows}
    shape = rows[0]
    about = (f"Mean accept length through SGLang's server (SmolLM2-135M + shipped head on the CPU test bed) at equal "
             f"budgets, depth {shape['depth']}, topk {shape['topk']}; {data['prompts']}, {data['max_new_tokens']} "
             f"greedy tokens each. eagle is SGLang's own selection (width W = topk); sequoia and specexec run the "
             f"plugin's draft loop at the width shown. Greedy output identical across all servers: "
             f"{'yes' if data['greedy_identical'] else 'no'}.")
    return "\n\n".join([about, run_lines(data, results, name, [name]),
                        table(["budget", *policies], [[b, *(cells.get((b, p)) for p in policies)] for b in budgets])])


def last_quarter_over_generic(data: dict[str, Any]) -> dict[str, float]:
    """Each other arm's accept length over the fixed generic head's, in the stream's last quarter ({} without a
    generic arm)."""
    last = {arm["arm"]: arm["quarters"][-1]["accept_length"] for arm in data["arms"]}
    if "generic" not in last:
        return {}
    return {arm: value / last["generic"] for arm, value in last.items() if arm != "generic"}


ADAPT_STREAMS = {"adapt_stream.json": ("A head that keeps learning while it serves",
                                         "a new passage each request"),
                 "adapt_stream_recurring.json": ("A head that keeps learning while it serves: recurring documents",
                                                 "each passage asked again later with a new question")}


def adapt_stream_body(name: str) -> Callable[[Path], str]:
    return lambda results: _adapt_stream_body(results, name)


def _adapt_stream_body(results: Path, name: str) -> str:
    data = load(results, name)
    arms = data["arms"]
    about = (f"One stream of document-extraction requests over the Python reference ({data['stream']}: "
             f"{ADAPT_STREAMS[name][1]}; no shipped "
             f"head trained on that domain), {data['max_new_tokens']} greedy tokens each, one at a time, through "
             f"SGLang's server (SmolLM2-135M, `{' '.join(data['tree'])}`). `generic`: the shipped generic head, "
             f"fixed; `adapt`: the same head at launch with `sglang-spec adapt {data['adapt_args']}` beside the "
             f"server (it shares the CPU with it); `domain`: a head batch-trained beforehand from the generic one on "
             f"{data['domain_prompts']} ({data['domain_steps']} steps on the last "
             f"{data['domain_seq_len']} tokens of each request), fixed. Accept length and tokens/s by quarter "
             f"of the stream. Greedy output identical across the arms: "
             f"{'yes' if data['greedy_identical'] else 'no'}.")
    quarters = [quarter["requests"] for quarter in arms[0]["quarters"]]
    rows = [[arm["arm"], *(f2(q["accept_length"]) for q in arm["quarters"]),
             *(f1(q["tokens_per_second"]) for q in arm["quarters"]), f"{arm['wall_seconds']:.0f}"] for arm in arms]
    plot = name.replace(".json", ".png")
    parts = [about, run_lines(data, results, name, [name, plot]),
             table(["arm", *(f"accept length, requests {q}" for q in quarters),
                    *(f"tok/s, requests {q}" for q in quarters), "wall s"], rows)]
    ratios = [f"`{arm}`'s accept length is {ratio:.2f}x" for arm, ratio in last_quarter_over_generic(data).items()]
    if ratios:
        parts.append(f"Last quarter: {' and '.join(ratios)} the fixed generic head's.")
    events = [event for arm in arms for event in arm.get("events", [])
              if event["event"] in ("train", "screen", "screened", "swap", "keep", "rollback")]
    if events:
        parts.append("What `adapt` did (seconds since it started, requests it had seen):\n\n" + "\n".join(
            f"* {event['time']:.0f} s, {event['requests_seen']} requests: {event['message']}" for event in events))
    parts.append(f"![accept length and tokens/s against requests served]({plot})")
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------ reference decoder


def hybrid_labels(config: dict[str, str]) -> dict[str, str]:
    def shape(text: str) -> str:
        parts = text.split(":")
        return "/".join(parts[:2]) + (f", {parts[2]} head levels" if len(parts) > 2 else "")

    labels = {"plain": "plain decoding (the project's)", "hf_plain": "Hugging Face `generate`",
              "lookup": "`--policy lookup`", "hybrid": f"`--policy hybrid` {shape(config.get('hybrid', ''))}",
              "auto": f"`--auto`, up to {shape(config.get('auto', ''))}"}
    mtp = config.get("mtp_tree", "")
    if mtp:
        policy, *rest = mtp.split(":")
        labels["mtp"] = f"MTP head only, {policy} {'/'.join(rest)}"
    return labels


def hybrid_body(results: Path) -> str:
    name = "hybrid.json"
    data = load(results, name)
    labels = hybrid_labels(data["config"])
    workloads = ", ".join(f"{count} {workload}" for workload, count in data["workloads"].items())
    parts = [
        f"The reference decoder (batch 1) on held-out prompts written for this bench (`bench/workloads/`: "
        f"{workloads} prompts), {data['config']['max_new_tokens']} new tokens each, against Hugging Face's prompt "
        f"lookup (`generate(prompt_lookup_num_tokens=k)`). Speedup = tokens/s over the project's plain decoding in "
        f"the same run; accept length = tokens a step emits, the bonus token included; latency = gaps between "
        f"tokens as a streaming client sees them; plain steps = the steps `--auto` decoded without a tree.",
        run_lines(data, results, name, [name, "hybrid.png"]),
    ]
    for temperature in sorted({row["temperature"] for row in data["rows"]}):
        rows = []
        for row in (row for row in data["rows"] if row["temperature"] == temperature):
            method = row["method"]
            label = labels.get(method) or re.sub(r"^hf_lookup_k(\d+)$", r"HF prompt lookup, k=\1", method)
            identical = "" if row["identical"] is None else ("yes" if row["identical"] else "no")
            plain_steps = f"{row['plain_steps']} / {row['steps']}" if method == "auto" else ""
            value = row["accept_length"]
            accept = f2(value) if value is not None and value == value and method != "plain" else ""  # NaN: none
            rows.append([row["workload"], label, f1(row["tokens_per_second"]), x(row["speedup"]), accept, identical,
                         f"{row['latency_p50_ms']:.0f} / {row['latency_p99_ms']:.0f}", plain_steps])
        parts.append(f"Temperature {temperature}:\n\n" + table(
            ["workload", "method", "tok/s", "speedup", "accept length", "greedy identical", "latency p50 / p99 ms",
             "plain steps"], rows))
    limits = data["limits"]
    plain = limits["plain_step_seconds"]
    rows = [["plain decode step", ms(limits["plain_step_floor_seconds"]), ms(plain), "1.00"]]
    rows += [[f"verify {n} tree tokens", ms(limits["verify_floor_seconds"][n]), ms(seconds), f"{seconds / plain:.2f}"]
             for n, seconds in limits["verify_seconds"].items()]
    parts.append(f"This machine's verify cost in the same run (`bench/limits.py`, {limits['context']}-token context; "
                 f"floor = the weights' bytes over the measured memory bandwidth, "
                 f"{limits['memory_bandwidth_gbs']:.1f} GB/s, or the arithmetic where that is longer):\n\n"
                 + table(["forward", "floor ms", "measured ms", "/ plain step"], rows))
    return "\n\n".join(parts)


def hybrid_shapes_body(results: Path) -> str:
    name = "hybrid_shapes.json"
    data = load(results, name)
    shapes = data["accept_length"]
    workloads = list(dict.fromkeys(w for values in shapes.values() for w in values))
    rows = [["/".join(key.split(":")[:2]) + f", {key.split(':')[2]} head levels",
             *(f2(values.get(w)) for w in workloads)] for key, values in shapes.items()]
    about = (f"Accept length of hybrid trees (budget / depth, head levels) in the reference decoder on the reference "
             f"bench's own code and extraction prompts, {data['max_new_tokens']} greedy tokens a prompt: how the "
             f"context trees' default depth (the budget) was chosen.")
    return "\n\n".join([about, run_lines(data, results, name, [name]), table(["shape", *workloads], rows)])


def copy_ceiling_body(results: Path) -> str:
    name = "copy_ceiling.json"
    data = load(results, name)
    drafters = list(dict.fromkeys(row["drafter"] for row in data["rows"]))
    workloads = list(dict.fromkeys(row["workload"] for row in data["rows"]))
    cell = {(row["workload"], row["drafter"]): f2(row["tokens_per_step"]) for row in data["rows"]}
    about = (f"Tokens a step that copying from the context could take on the serving sweep's held-out prompts "
             f"(depth {data['depth']}, {data['max_new_tokens']} tokens, the target's greedy output replayed, no "
             f"timing): `best-copy` always copies the best span, `lookup-chain` is prompt lookup's chain, "
             f"`lookup-tree` any of the context lookup's first {data['lookup_width']} candidates at every depth.")
    return "\n\n".join([about, run_lines(data, results, name, [name]),
                        table(["workload", *drafters],
                              [[w, *(cell.get((w, d)) for d in drafters)] for w in workloads])])


def planner_projection_body(results: Path) -> str:
    name = "planner_projection.json"
    data = load(results, name)
    about = ("**A projection, not a measurement.** What the step planner would choose at DeepSeek-R1's verify cost "
             f"on an H200 (the `verify_cost` GPU check's dense, MoE and head pieces composed to 61 layers, from "
             f"`{data['costs']}`) with the tokens a request committed at each verify size as served through "
             f"`launch_server` on the CPU bed (its plan logs), the step cap {data['cap']:g} plain steps. Drafting "
             "and host work on a GPU are left out, so the figures bound what the verify cost and the served "
             "acceptance allow.")
    rows = [[workload, row["batch"], row["size"], f2(row["tokens_per_step"]), f1(row["step_ms"]), x(row["speedup"])]
            for workload, projected in data["workloads"].items() for row in projected]
    return "\n\n".join([about, run_lines(data, results, name, [name]),
                        table(["workload", "batch", "verify size", "tokens / request / step", "step ms",
                               "projected x plain"], rows)])


# ------------------------------------------------------------------------------------------------ heads


QUALITY_HEADER = ["head", "depth-1 top-1", "top-4", "top-8", "chain-4 accept length",
                  "sequoia 16 / 32 / 168", "specexec 16 / 32 / 168"]


def quality_rows(quality: dict[str, dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for head, q in quality.items():
        trees = {policy: " / ".join(f2(q[f"{policy}{n}_accept_length"]) for n in (16, 32, 168))
                 for policy in ("sequoia", "specexec")}
        rows.append([head, f"{q['depth1_top1']:.3f}", f"{q['depth1_top4']:.3f}", f"{q['depth1_top8']:.3f}",
                     f2(q["chain4_accept_length"]), trees["sequoia"], trees["specexec"]])
    return rows


def acceptance_body(results: Path) -> str:
    name = "acceptance.json"
    data = load(results, name)
    config = data["config"]
    rows = [[row["head"], row["temperature"], row["method"], row["budget"], row["depth"],
             f2(row["accept_length"]) if row["method"] != "prompt_lookup" else "", f1(row["tokens_per_second"]),
             f2(row["speedup"]), f2(row.get("predicted_speedup")),
             "" if row["identical"] is None else ("yes" if row["identical"] else "no")] for row in data["rows"]]
    prompts = data["prompts"]
    vocab = data["draft_vocabulary"]
    vocab_line = "; ".join(
        f"{head}: {v['draft_vocab_size']} of {v['vocab_size']} tokens, one draft level "
        f"{ms(v['draft_level_seconds'])} ms against {ms(v['full_vocab_draft_level_seconds'])} ms over the full "
        f"vocabulary" for head, v in vocab.items())
    prediction = data["prediction"]
    sequoia = prediction["sequoia_measured_over_predicted_accept_length"]
    pngs = [path.name for path in sorted(results.glob("acceptance-*.png"))]
    return "\n\n".join([
        f"The shipped SmolLM2 heads (`generic`: chat traffic; `code`: fine-tuned on code) in the reference decoder, "
        f"batch 1, on {len(prompts)} held-out prompts ({prompts[0]} to {prompts[-1]}), {config['max_new_tokens']} "
        f"new tokens each, every policy at budgets {config['budgets']}, depth {config['depths']}, temperatures "
        f"{config['temperatures']}. Speedup = tokens/s over plain decoding in the same run; predicted = the cost "
        f"model's prediction (`costs.step_seconds`).",
        run_lines(data, results, name, [name, *pngs]),
        table(["head", "T", "method", "budget", "depth", "accept length", "tok/s", "speedup", "predicted",
               "greedy identical"], rows),
        "Head quality on the same prompts (greedy; accept lengths of trees of 16 / 32 / 168 nodes):\n\n"
        + table(QUALITY_HEADER, quality_rows(data["head_quality"])),
        f"Draft vocabulary: {vocab_line}. Predicted against measured speedup: Pearson r {prediction['pearson_r']:.2f}, "
        f"mean absolute error {prediction['mean_abs_error']:.2f} over {prediction['points']} configurations; "
        f"Sequoia's measured accept length over its predicted one {sequoia['min']:.2f}-{sequoia['max']:.2f}.",
    ])


def head_quality_body(results: Path) -> str:
    name = "head-quality.json"
    data = load(results, name)
    prompts = data["prompts"]
    about = (f"The same head-quality measurement over every held-out task ({len(prompts)} prompts, {prompts[0]} to "
             f"{prompts[-1]}), {data['max_new_tokens']} greedy tokens each, no timing.")
    if data.get("note"):
        about += f" Note: {data['note']}."
    return "\n\n".join([about, run_lines(data, results, name, [name]),
                        table(QUALITY_HEADER, quality_rows(data["head_quality"]))])


# ------------------------------------------------------------------------------------------------ GPU


def gpu_records(results: Path) -> list[str]:
    """The filed GPU results (``gpu/*.json``) by date then name, and an unfiled ``gpu-check.json`` last."""
    def date(name: str) -> str:
        return load(results, name).get("environment", {}).get("date", "")

    filed = sorted((f"gpu/{path.name}" for path in (results / "gpu").glob("*.json")), key=lambda n: (date(n), n))
    return filed + (["gpu-check.json"] if (results / "gpu-check.json").exists() else [])


def gpu_latest(results: Path) -> dict[tuple[str, str], tuple[dict[str, Any], str]]:
    """(device, check) -> the latest result of that check on that device and the file holding it."""
    latest: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}
    for name in gpu_records(results):
        data = load(results, name)
        if data.get("dry_run"):
            continue
        device = data["environment"]["device"]
        for check in data["checks"]:
            latest[device, check["name"]] = (check, name)
    return latest


def gpu_tally(latest: dict[tuple[str, str], tuple[dict[str, Any], str]]) -> str:
    """Per device, of the latest results: how many checks passed of those that ran, and how many were skipped."""
    statuses: dict[str, list[str]] = {}
    for (device, _), (check, _) in latest.items():
        statuses.setdefault(device, []).append(check["status"])
    return "; ".join(f"{device}: {s.count('passed')} of {len(s) - s.count('skipped')} passed"
                     + (f", {s.count('skipped')} skipped" if "skipped" in s else "") for device, s in statuses.items())


def gpu_logs(results: Path, name: str) -> list[str]:
    stem = Path(name).stem
    folder = results / Path(name).parent
    return sorted(f"{Path(name).parent}/{p.name}".removeprefix("./") for p in folder.glob(f"{stem}*")
                  if p.suffix != ".json")


def gpu_body(results: Path) -> str:
    latest = gpu_latest(results)
    rows = [[device, f"`{check['name']}`", f"**{check['status']}**", f"{check['seconds']:.0f}", check["detail"],
             f"[{name}]({name})"] for (device, _), (check, name) in latest.items()]
    what: dict[str, str] = {}
    for check, _ in latest.values():
        what[check["name"]] = check["what"]
    runs = []
    for name in gpu_records(results):
        data = load(results, name)
        files = [name, *gpu_logs(results, name)]
        runs.append(f"* [{name}]({name}): {machine(data, results, name)}; `{command(data, results, name)}`; "
                    + ", ".join(f"[{file}]({file})" for file in files[1:]))
    return "\n\n".join([
        "`scripts/gpu_check.sh` on the GPUs lent to this project (none had sglang installed; the server groups carry "
        "it, see docs/gpu-validation.md). The latest result of every check on every device; older results of a "
        f"check stay in the files. {gpu_tally(latest)} (a skipped check waited on one that failed).",
        table(["device", "check", "result", "s", "detail", "record"], rows),
        "What each check runs:\n\n" + "\n".join(f"* `{check}`: {text}" for check, text in what.items()),
        "Records (results JSON, machine, command, console logs):\n\n" + "\n".join(runs),
    ])


# ------------------------------------------------------------------------------------------------ the page


def sections(results: Path) -> list[Section]:
    out = [Section(SERVING_TITLES.get(name, f"Serving: {name[:-len('.json')]}"), [name], serving_body(name))
           for name in serving_files(results)]
    for title, name, body in (
        ("Tree shapes through SGLang at equal budgets", "sglang_trees.json", sglang_trees_body),
        *((title, name, adapt_stream_body(name)) for name, (title, _) in ADAPT_STREAMS.items()),
        ("Hybrid trees against prompt lookup in the reference decoder", "hybrid.json", hybrid_body),
        ("Context tree depth", "hybrid_shapes.json", hybrid_shapes_body),
        ("Copy ceiling of the serving prompts", "copy_ceiling.json", copy_ceiling_body),
        ("Planner at R1's shape on an H200: a projection", "planner_projection.json", planner_projection_body),
        ("Head acceptance sweep", "acceptance.json", acceptance_body),
        ("Head quality on every held-out task", "head-quality.json", head_quality_body),
    ):
        if (results / name).exists():
            out.append(Section(title, [name], body))
    if gpu_records(results):
        out.append(Section("GPU checks", [], gpu_body))
    return out


def render_page(results: Path = RESULTS) -> str:
    parts = [
        "# Results",
        "Generated by `python bench/report.py` from the JSON files in this folder: do not edit it by hand "
        "(`tests/docs/test_results_page.py` fails when it is stale). Each benchmark writes its JSON here under a "
        "stable name; rerun the benchmark, then the report. Conventions: budget = draft tokens, root excluded; "
        "accept length = draft tokens accepted in a step + 1 (the bonus token); speedups are over plain decoding "
        "measured in the same run. Machines and commands come from the JSON, or from "
        f"[{RECORDED}]({RECORDED}) where a benchmark's JSON does not carry them.",
        "\n".join(f"* [{section.title}](#{section.anchor})" for section in sections(results)),
    ]
    serving_done = False
    for section in sections(results):
        if section.title.startswith("Serving") and not serving_done:
            parts.append(SERVING_NOTE)
            serving_done = True
        parts.append(f"## {section.title}")
        parts.append(section.body(results))
    return "\n\n".join(parts) + "\n"


def named_files(page: str) -> set[str]:
    """Every file the page links to (relative to the results folder)."""
    return {target for target in re.findall(r"\]\(([^)#]+)\)", page) if "://" not in target}


# ------------------------------------------------------------------------------------------------ README headline


def _rows(results: Path, name: str) -> list[dict[str, Any]]:
    data = load(results, name)
    return data["rows"] if isinstance(data, dict) else data


def _pick(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [row for row in rows if all(row.get(key) == value for key, value in match.items())]
    if len(found) != 1:
        raise ValueError(f"expected one row matching {match}, found {len(found)}")
    return found[0]


def _planner(rows: list[dict[str, Any]], workload: str, policy: str) -> dict[str, Any]:
    """The row of a planner server (``auto``, ``auto-batch``) on ``workload``: its run with SGLang's overlap loop off
    (``-sync``) where the sweep ran one, as its ratio is over the faster plain server, which on the CPU bed is the
    one without that loop."""
    synced = [row for row in rows if row.get("workload") == workload and row.get("policy") == f"{policy}-sync"]
    return synced[0] if synced else _pick(rows, workload=workload, policy=policy)


def _loop(rows: list[dict[str, Any]]) -> str:
    """How the headline names the planner's loop: "" (SGLang's overlap loop, the default) or its -sync run's."""
    return ", overlap loop off" if any(row.get("policy") in ("auto-sync", "auto-batch-sync") for row in rows) else ""


def _workloads(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(row["workload"] for row in rows))


def render_headline(results: Path = RESULTS, page: str = "docs/results/README.md") -> str:
    """The README's results table: one row per headline figure, its command and a link to its section."""
    rows = []

    def link(title: str) -> str:
        return f"[details]({page}#{slug(title)})"

    def add(what: str, name: str, figure: str, title: str) -> None:
        rows.append([what, figure, f"`{command(load(results, name), results, name)}`", link(title)])

    for name, what in (("serving_sweep_c1.json", "SGLang server, 1 request: `--speculative-tree-auto` over the "
                                                 "faster plain decoding (x) and its accept length"),
                       ("serving_sweep_c16.json", "SGLang server, 16 requests: `--speculative-tree-auto` over the "
                                                  "faster plain decoding")):
        if (results / name).exists():
            data = _rows(results, name)
            cells = []
            for workload in _workloads(data):
                auto = _planner(data, workload, "auto")
                accept = f" (AL {auto['accept_length']:.2f})" if name.endswith("c1.json") else ""
                cells.append(f"{workload} **{x(auto['speedup_over_plain'])}**{accept}")
            add(what + _loop(data), name, ", ".join(cells), SERVING_TITLES[name])
    name = "serving_sweep_mixed_c4.json"
    if (results / name).exists():
        data = _rows(results, name)
        cells = []
        for workload in _workloads(data):
            auto, batch = (_planner(data, workload, policy) for policy in ("auto", "auto-batch"))
            cells.append(f"{workload} **{x(auto['speedup_over_plain'])}** / {x(batch['speedup_over_plain'])}")
        add("SGLang server, 4 requests: the per-step planner / the same planner choosing a plain step or the full "
            "tree, over the faster plain decoding" + _loop(data), name, ", ".join(cells), SERVING_TITLES[name])
    name = "serving_sweep_tp2_c1.json"
    if (results / name).exists():
        found = tp_ratios(_rows(results, name))
        cells = [f"{item['workload']} **{x(item['ratios'][2])}** ({x(item['ratios'][1])})" for item in found
                 if item["policy"] in ("auto", "auto-sync")]
        add("SGLang server, 1 request, SmolLM2 split over 2 ranks (`--tp-size 2`, zero heads added): "
            "`--speculative-tree-auto` over plain decoding at TP 2 (at TP 1)" + _loop(_rows(results, name)), name,
            ", ".join(cells), SERVING_TITLES[name])
    name = "serving_sweep_peers.json"
    if (results / name).exists():
        data = _rows(results, name)
        cells = []
        for workload in _workloads(data):
            ours, eagle, ngram = (_pick(data, workload=workload, policy=p)["accept_length"]
                                  for p in ("hybrid", "sglang-tree", "sglang-ngram"))
            cells.append(f"{workload} **{ours:.2f}** vs {eagle:.2f} / {ngram:.2f}")
        add("SGLang server, accept length at 15 draft tokens: `hybrid` vs SGLang's EAGLE tree / NGRAM", name,
            ", ".join(cells), SERVING_TITLES[name])
    for name, (title, stream) in ADAPT_STREAMS.items():
        if not (results / name).exists():
            continue
        data = load(results, name)
        ratios = last_quarter_over_generic(data)
        if {"adapt", "domain"} <= ratios.keys():
            add(f"SGLang server, one stream of held-out extraction requests ({data['stream']}: {stream}): the last "
                f"quarter's accept length with `sglang-spec adapt` / a batch-trained domain head, over the fixed "
                f"generic head", name, f"adapt **{x(ratios['adapt'])}** / domain {x(ratios['domain'])}", title)
    name = "hybrid.json"
    if (results / name).exists():
        data = [row for row in load(results, name)["rows"] if row["temperature"] == 0.0]
        cells = []
        for workload in _workloads(data):
            auto = _pick(data, workload=workload, method="auto")["speedup"]
            lookup = max(row["speedup"] for row in data if row["workload"] == workload
                         and row["method"].startswith("hf_lookup"))
            cells.append(f"{workload} **{x(auto)}** ({x(lookup)})")
        add("Reference decoder, batch 1, greedy: `--auto` over plain decoding (best Hugging Face prompt lookup)",
            name, ", ".join(cells), "Hybrid trees against prompt lookup in the reference decoder")
    name = "head-quality.json"
    if (results / name).exists():
        data = load(results, name)
        q = data["head_quality"]["code"]
        figure = (f"top-1 **{q['depth1_top1']:.3f}**, chain-4 AL **{q['chain4_accept_length']:.2f}**, specexec "
                  + " / ".join(f"{q[f'specexec{n}_accept_length']:.2f}" for n in (16, 32, 168)))
        add(f"Shipped SmolLM2 code head on {len(data['prompts'])} held-out HumanEval tasks: depth-1 top-1, "
            f"chain-4 and tree (16 / 32 / 168 nodes) accept length", name, figure,
            "Head quality on every held-out task")
    if gpu_records(results):
        latest = gpu_latest(results)
        groups = ",".join(dict.fromkeys(check.get("group", "kernels") for check, _ in latest.values()))
        rows.append(["GPU checks (kernels compiled, CUDA graphs, no host sync, MLA verify on FlashInfer, SGLang's "
                     "server), latest result per check", gpu_tally(latest), f"`scripts/gpu_check.sh --group {groups}`",
                     link("GPU checks")])
    return table(["result", "figure", "command", "page"], rows)


def update_readme(text: str, headline: str) -> str:
    """``text`` with the block between the markers replaced by ``headline``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    return text[:start + len(BEGIN)] + "\n" + headline + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that both are current (exit 1 if not)")
    args = parser.parse_args(argv)
    page = render_page()
    readme = update_readme(README.read_text(), render_headline())
    stale = [path for path, text in ((PAGE, page), (README, readme)) if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(REPO)} is stale: run python bench/report.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in ((PAGE, page), (README, readme)):
        path.write_text(text)
    print(f"wrote {PAGE.relative_to(REPO)} and the results table of {README.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
