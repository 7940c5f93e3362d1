"""Serving throughput and latency across concurrency x tree budget x policy, with SGLang's own benchmark client.

For every (policy, budget) the script launches ``python -m sglang.launch_server`` with the tree options, waits for
``/health``, runs ``python -m sglang.bench_serving`` at each concurrency, stops the server, and collects the
client's JSON lines into a CSV and a plot (output tokens/s and mean accept length against concurrency).

    python bench/serving_sweep.py --model-path deepseek-ai/DeepSeek-R1 --server-args "--tp 8 --attention-backend fa3" \\
        --policies chain,sequoia,specexec --budgets 4,8,16 --concurrency 1,4,16,64 \\
        --acceptance-profile r1-profile.json
    python bench/serving_sweep.py --dry-run ...     # print the commands only (any machine)

Needs a GPU host with sglang installed; on a CPU it explains itself and exits.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIELDS = ["policy", "budget", "concurrency", "request_throughput", "output_throughput", "mean_ttft_ms",
          "mean_tpot_ms", "mean_itl_ms", "accept_length"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="deepseek-ai/DeepSeek-R1")
    parser.add_argument("--server-args", default="", help="extra launch_server arguments")
    parser.add_argument("--policies", default="chain,eagle,sequoia,specexec")
    parser.add_argument("--budgets", default="4,8,16")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--dataset", default="random", help="bench_serving --dataset-name")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=1024)
    parser.add_argument("--acceptance-profile", default=None)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "serving_sweep.csv")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser.parse_args(argv)


def launch_command(args, policy: str, budget: int) -> list[str]:
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path, "--port", str(args.port),
               "--speculative-algorithm", "NEXTN", "--speculative-tree-policy", policy,
               "--speculative-tree-budget", str(budget), "--speculative-tree-depth", str(args.depth)]
    if policy != "chain":
        command += ["--speculative-tree-topk", str(args.topk)]
    if policy == "sequoia":
        if not args.acceptance_profile:
            raise SystemExit("error: the sequoia policy needs --acceptance-profile (sglang-spec calibrate)")
        command += ["--speculative-acceptance-profile", args.acceptance_profile]
    return command + shlex.split(args.server_args)


def bench_command(args, concurrency: int, output: Path) -> list[str]:
    return [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(args.port),
            "--dataset-name", args.dataset, "--num-prompts", str(args.num_prompts), "--max-concurrency",
            str(concurrency), "--random-input-len", str(args.random_input_len), "--random-output-len",
            str(args.random_output_len), "--output-file", str(output)]


def wait_healthy(port: int, timeout: float = 1800) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(5)
    raise SystemExit(f"error: the server did not become healthy within {timeout:.0f} s")


def row_from_result(policy: str, budget: int, concurrency: int, result: dict) -> dict:
    """One CSV row from bench_serving's JSON result line (accept length included when the server reports it)."""
    return {
        "policy": policy, "budget": budget, "concurrency": concurrency,
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "mean_ttft_ms": result.get("mean_ttft_ms"),
        "mean_tpot_ms": result.get("mean_tpot_ms"),
        "mean_itl_ms": result.get("mean_itl_ms"),
        "accept_length": result.get("accept_length"),
    }


def write_csv_and_plot(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (policy, budget) in sorted({(r["policy"], r["budget"]) for r in rows}):
        points = sorted((r["concurrency"], r) for r in rows if (r["policy"], r["budget"]) == (policy, budget))
        concurrency = [c for c, _ in points]
        axes[0].plot(concurrency, [r["output_throughput"] or 0 for _, r in points], marker="o",
                     label=f"{policy} {budget}")
        axes[1].plot(concurrency, [r["accept_length"] or 0 for _, r in points], marker="o", label=f"{policy} {budget}")
    for axis, label in zip(axes, ("output tokens/s", "mean accept length")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    policies = args.policies.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.dry_run:
        for policy in policies:
            for budget in budgets:
                print(" ".join(shlex.quote(part) for part in launch_command(args, policy, budget)))
                for concurrency in concurrencies:
                    print("  " + " ".join(shlex.quote(p) for p in bench_command(args, concurrency, Path("out.jsonl"))))
        return 0
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        print("bench/serving_sweep.py launches SGLang servers and needs a GPU host with sglang installed; there is "
              "no GPU here. Use --dry-run to see the commands it would run.")
        return 0
    rows = []
    scratch = args.out.parent / "serving_runs"
    scratch.mkdir(parents=True, exist_ok=True)
    for policy in policies:
        for budget in budgets:
            server = subprocess.Popen(launch_command(args, policy, budget))
            try:
                wait_healthy(args.port)
                for concurrency in concurrencies:
                    output = scratch / f"{policy}-{budget}-{concurrency}.jsonl"
                    subprocess.run(bench_command(args, concurrency, output), check=True)
                    result = json.loads(output.read_text().strip().splitlines()[-1])
                    rows.append(row_from_result(policy, budget, concurrency, result))
                    print(rows[-1], flush=True)
            finally:
                server.terminate()
                server.wait(timeout=120)
    write_csv_and_plot(rows, args.out)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
