"""Serving throughput and latency across concurrency x tree shape x policy, with SGLang's own benchmark client.

For every policy (``plain`` = no speculation) and budget the script launches ``python -m sglang.launch_server``
with the tree options, waits for ``/health``, runs ``python -m sglang.bench_serving`` at each concurrency, stops
the server (its whole process group), and collects the client's JSON lines into a CSV and a plot: output
tokens/s, mean accept length and p50 / p99 inter-token latency against concurrency (speculation makes tokens
arrive in bursts: p50 ITL falls while p99 can rise).

    # this CPU, through the project's harness (SmolLM2-135M + shipped head, or the tiny DeepSeek-V3):
    python bench/serving_sweep.py --cpu-model smollm2 --policies plain,chain,sequoia --budgets 15 \\
        --concurrency 1,2,4 --num-prompts 8 --random-input-len 64 --random-output-len 32
    # a GPU host:
    python bench/serving_sweep.py --model-path deepseek-ai/DeepSeek-R1 --server-args "--tp 8 --attention-backend fa3" \\
        --policies plain,chain,sequoia,specexec --budgets 4,8,16 --concurrency 1,4,16,64 \\
        --acceptance-profile r1-profile.json
    python bench/serving_sweep.py --dry-run ...     # print the commands only
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from sglang_spec.errors import SpecError, exit_status
from sglang_spec.files import check_output_path, write_text_atomic

REPO = Path(__file__).resolve().parents[1]
FIELDS = ["policy", "budget", "concurrency", "request_throughput", "output_throughput", "mean_ttft_ms",
          "mean_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "accept_length"]
POLICIES = ("plain", "chain", "eagle", "sequoia", "specexec")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--cpu-model", choices=("smollm2", "tiny-deepseek"), default=None,
                        help="serve on this CPU through the project's harness")
    target.add_argument("--model-path", default=None, help="a model for launch_server on a GPU host")
    parser.add_argument("--server-args", default="", help="extra launch_server arguments")
    parser.add_argument("--policies", default="plain,chain,eagle,sequoia,specexec")
    parser.add_argument("--budgets", default="4,8,16")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--dataset", default="heldout",
                        help="heldout (HumanEval 134-163 as chat requests, never in the shipped heads' training; "
                             "written as a ShareGPT file, no download) or any bench_serving --dataset-name")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=1024, help="output tokens per request")
    parser.add_argument("--acceptance-profile", default=None,
                        help="sequoia's profile (default on the CPU: the one shipped with the head)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--start-timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "serving_sweep.csv")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policy {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    if args.cpu_model is None and args.model_path is None:
        args.model_path = "deepseek-ai/DeepSeek-R1"
    return args


def tree_arguments(args, policy: str, budget: int, profile: str | None) -> list[str]:
    if policy == "plain":
        return []
    arguments = ["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", policy,
                 "--speculative-tree-budget", str(budget), "--speculative-tree-depth", str(args.depth)]
    if policy != "chain":
        arguments += ["--speculative-tree-topk", str(args.topk)]
    if policy == "sequoia":
        if not profile:
            raise SystemExit("error: the sequoia policy needs --acceptance-profile (sglang-spec calibrate)")
        arguments += ["--speculative-acceptance-profile", profile]
    return arguments


def launch_command(args, policy: str, budget: int, profile: str | None = None) -> list[str]:
    """launch_server arguments on a GPU host (the CPU path builds them with the harness)."""
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path, "--port", str(args.port)]
    return command + tree_arguments(args, policy, budget, profile or args.acceptance_profile) + shlex.split(args.server_args)


def bench_command(args, concurrency: int, output: Path, heldout: Path | None = None) -> list[str]:
    command = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1",
               "--port", str(args.port), "--num-prompts", str(args.num_prompts), "--max-concurrency",
               str(concurrency), "--output-file", str(output)]
    if args.dataset == "heldout":
        return command + ["--dataset-name", "sharegpt", "--dataset-path", str(heldout or "heldout.json"),
                          "--sharegpt-output-len", str(args.random_output_len), "--apply-chat-template"]
    return command + ["--dataset-name", args.dataset, "--random-input-len", str(args.random_input_len),
                      "--random-output-len", str(args.random_output_len), "--random-range-ratio", "1.0"]


def write_heldout_dataset(path: Path) -> Path:
    """HumanEval 134-163 (held out from the shipped heads' traffic) in ShareGPT's format for bench_serving."""
    from sglang_spec.train.prompts import humaneval_prompts

    conversations = [{"conversations": [{"from": "human", "value": spec.messages[0]["content"]},
                                        {"from": "gpt", "value": spec.reference}]}
                     for spec in humaneval_prompts(134, 163)]
    path.write_text(json.dumps(conversations))
    return path


def row_from_result(policy: str, budget: int, concurrency: int, result: dict) -> dict:
    """One CSV row from bench_serving's JSON result line (accept length when the server reports it)."""
    return {"policy": policy, "budget": 0 if policy == "plain" else budget, "concurrency": concurrency,
            **{name: result.get(name) for name in FIELDS[3:]}}


def write_csv_and_plot(rows: list[dict], out: Path) -> None:
    from sglang_spec.files import atomic_write

    with atomic_write(out) as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_throughput", "output tokens/s"), ("accept_length", "mean accept length"),
              ("median_itl_ms", "p50 inter-token latency (ms)"), ("p99_itl_ms", "p99 inter-token latency (ms)"))
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for policy, budget in sorted({(row["policy"], row["budget"]) for row in rows}):
        points = sorted((row["concurrency"], row) for row in rows if (row["policy"], row["budget"]) == (policy, budget))
        label = policy if policy == "plain" else f"{policy} {budget}"
        for axis, (field, _) in zip(axes, panels):
            values = [row[field] or (1.0 if field == "accept_length" else 0.0) for _, row in points]
            axis.plot([c for c, _ in points], values, marker="o", label=label)
    for axis, (_, label) in zip(axes, panels):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(figure)


def print_table(rows: list[dict]) -> None:
    print(f"{'policy':<10}{'budget':>7}{'conc':>6}{'out tok/s':>11}{'AL':>6}{'p50 ITL':>10}{'p99 ITL':>10}")
    for row in rows:
        print(f"{row['policy']:<10}{row['budget']:>7}{row['concurrency']:>6}{row['output_throughput'] or 0:>11.2f}"
              f"{row['accept_length'] or 1.0:>6.2f}{row['median_itl_ms'] or 0:>10.1f}{row['p99_itl_ms'] or 0:>10.1f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    policies = args.policies.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    shapes = [(policy, budget) for policy in policies for budget in (budgets[:1] if policy == "plain" else budgets)]
    if args.dry_run:
        for policy, budget in shapes:
            launch = launch_command(args, policy, budget) if args.cpu_model is None else \
                [sys.executable, "-m", "sglang_spec.sglang_plugin.cpu", "--model", args.cpu_model,
                 *(["--no-speculation"] if policy == "plain" else []),
                 *tree_arguments(args, policy, budget, args.acceptance_profile or "<shipped profile>")]
            print(" ".join(shlex.quote(part) for part in launch))
            for concurrency in concurrencies:
                print("  " + " ".join(shlex.quote(p) for p in bench_command(args, concurrency, Path("out.jsonl"))))
        return 0
    from sglang_spec.sglang_plugin.cpu.server import SGLangServer, cpu_launch_args, prepare_model

    check_output_path(args.out, force=True)  # a bad --out fails now, not after the run
    if args.cpu_model is None:
        import torch

        if not torch.cuda.is_available():
            print("error: no GPU here; use --cpu-model smollm2 to sweep through the CPU harness, or --dry-run",
                  file=sys.stderr)
            return 2
    model = prepare_model(args.cpu_model) if args.cpu_model else None
    profile = args.acceptance_profile or (str(model.profile) if model and model.profile else None)
    scratch = REPO / "runs" / "serving_sweep"  # server logs and the held-out dataset (gitignored)
    scratch.mkdir(parents=True, exist_ok=True)
    heldout = write_heldout_dataset(scratch / "heldout.json") if args.dataset == "heldout" else None
    rows = []
    for policy, budget in shapes:
        name = policy if policy == "plain" else f"{policy}-{budget}"
        if model is not None:
            launch = cpu_launch_args(model, args.port, speculative=policy != "plain",
                                     extra=tree_arguments(args, policy, budget, profile) + shlex.split(args.server_args))
            server = SGLangServer(launch, args.port, scratch / f"{name}.log")
        else:
            launch = launch_command(args, policy, budget, profile)[3:]
            server = SGLangServer(launch, args.port, scratch / f"{name}.log", env=dict(os.environ), cpu=False)
        try:
            server.start(timeout=args.start_timeout)
        except SpecError as error:
            print(f"error: {name}: {error}", file=sys.stderr)
            return 1
        try:
            for concurrency in concurrencies:
                output = scratch / f"{name}-c{concurrency}.jsonl"
                output.unlink(missing_ok=True)
                with (scratch / f"{name}-c{concurrency}.client.log").open("w") as client_log:
                    finished = subprocess.run(bench_command(args, concurrency, output, heldout), env=server.env,
                                              stdout=client_log, stderr=subprocess.STDOUT)
                if finished.returncode != 0:
                    print(f"error: bench_serving failed for {name} at concurrency {concurrency}; see "
                          f"{client_log.name}", file=sys.stderr)
                    return 1
                result = json.loads(output.read_text().strip().splitlines()[-1])
                rows.append(row_from_result(policy, budget, concurrency, result))
                print(f"{name} concurrency {concurrency}: {rows[-1]['output_throughput']:.2f} tok/s", flush=True)
        finally:
            server.stop()
    print_table(rows)
    write_csv_and_plot(rows, args.out)
    write_text_atomic(args.out.with_suffix(".json"), json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}, {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
