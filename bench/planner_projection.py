"""A PROJECTION, not a measurement: what the step planner would choose and give at DeepSeek-R1's shape on an H200, at
batch sizes 1-64, from two measured inputs:

* the verify forward's cost at DeepSeek-V3's layer dimensions by batch size and tokens a request, measured on an
  H200 by ``scripts/gpu_check.sh`` (``verify_cost``: dense, MoE and head pieces composed to 61 layers); and
* the tokens a request commits per step at each verify size, as served through ``launch_server`` on the CPU bed
  with ``--speculative-tree-auto`` (``SGLANG_SPEC_PLAN_LOG`` files, one per workload).

For every batch size it runs the planner's own chooser (``planner.choose_size``, the step cap included) on the
projected table and prints the chosen size and the projected speedup over plain decoding. Drafting and host work
are not in the projection (they are in the served steps on the bed, not on an H200): the figures bound what the
verify cost and the served acceptance allow.

    python bench/planner_projection.py --served code=plan-code.jsonl --served mixed=plan-mixed.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import REPO, markdown_table

from sglang_spec.costs import interpolate_seconds
from sglang_spec.errors import SpecError, exit_status
from sglang_spec.files import check_output_path, read_json, write_json_atomic
from sglang_spec.planner import SizeTable, choose_size

DEFAULT_COSTS = REPO / "docs" / "results" / "gpu" / "h200-all.json"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
LAYERS, DENSE_LAYERS = 61, 3


def verify_table(path: Path) -> dict[int, dict[int, float]]:
    """batch -> {tokens a request -> seconds of the 61-layer verify forward}, from a GPU check's ``verify_cost``."""
    checks = read_json(path).get("checks", [])
    found = [check for check in checks if check.get("name") == "verify_cost" and check.get("status") == "passed"]
    if not found:
        raise SpecError(f"{path} holds no passed verify_cost check (run scripts/gpu_check.sh --group kernels)")
    table: dict[int, dict[int, float]] = {}
    for piece in found[0]["data"]["pieces"]:
        seconds = (DENSE_LAYERS * piece["dense_layer_s"] + (LAYERS - DENSE_LAYERS) * piece["moe_layer_s"]
                   + piece["head_s"])
        table.setdefault(int(piece["batch"]), {})[int(piece["nodes"])] = seconds
    return table


def served_accept(path: Path) -> dict[int, float]:
    """Verify size -> mean tokens a request committed per step at that size, from a plan log."""
    sums: dict[int, list[float]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
            committed = [int(value) for value in record["committed"]]
            tokens = int(record["tokens"])
        except (ValueError, KeyError, TypeError) as error:
            raise SpecError(f"{path}:{number}: not a plan log line ({error})") from None
        total = sums.setdefault(tokens, [0.0, 0.0])
        total[0] += sum(committed)
        total[1] += len(committed)
    if 1 not in sums or len(sums) < 2:
        raise SpecError(f"{path}: a plan log needs plain steps and tree steps (it has sizes {sorted(sums)})")
    return {size: total / count for size, (total, count) in sorted(sums.items())}


def accept_at(served: dict[int, float], size: int) -> float:
    """Tokens a request commits at ``size``: linear between served sizes, the largest served size's beyond it."""
    sizes = sorted(served)
    if size >= sizes[-1]:
        return served[sizes[-1]]
    return interpolate_seconds(served, size)


def project(costs: dict[int, dict[int, float]], served: dict[int, float], cap: float) -> list[dict]:
    rows = []
    sizes = sorted(next(iter(costs.values())))
    for batch in BATCHES:
        if batch not in costs:
            continue
        table = SizeTable(tuple(sizes), tuple(batch * accept_at(served, size) for size in sizes),
                          tuple(costs[batch][size] for size in sizes))
        size, expected, seconds = choose_size(table, cap * costs[batch][1])
        plain = batch / costs[batch][1]
        rows.append({"batch": batch, "size": size, "tokens_per_step": expected / batch,
                     "step_ms": 1e3 * seconds, "speedup": expected / seconds / plain})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", type=Path, default=DEFAULT_COSTS, help="a GPU check's results JSON")
    parser.add_argument("--served", action="append", required=True, metavar="NAME=PLAN_LOG",
                        help="a workload's plan log from the CPU bed (SGLANG_SPEC_PLAN_LOG); repeat per workload")
    parser.add_argument("--cap", type=float, default=2.0, help="the step cap in plain steps (the server's default)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "planner_projection.json")
    given = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(given)
    check_output_path(args.out, force=True)
    costs = verify_table(args.costs)
    results = {}
    for item in args.served:
        name, _, path = item.partition("=")
        if not path:
            raise SpecError(f"--served {item!r}: give NAME=PLAN_LOG")
        results[name] = project(costs, served_accept(Path(path)), args.cap)
    print("PROJECTION (not a measurement): the planner's choice at R1's verify cost on an H200, served acceptance "
          "from the CPU bed; drafting and host work left out")
    header = ["workload", "batch", "verify size", "tokens / step", "step ms", "projected x plain"]
    rows = [[name, row["batch"], row["size"], f"{row['tokens_per_step']:.2f}", f"{row['step_ms']:.0f}",
             f"{row['speedup']:.2f}x"] for name, projected in results.items() for row in projected]
    print("\n".join(markdown_table(header, rows)))
    write_json_atomic(args.out, {"kind": "projection", "costs": str(args.costs.relative_to(REPO))
                                 if args.costs.is_relative_to(REPO) else str(args.costs), "cap": args.cap,
                                 "command": "python bench/planner_projection.py " + " ".join(given),
                                 "workloads": results})
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
