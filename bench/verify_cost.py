"""Verify cost of a DeepSeek-V3-sized target on this GPU, and the speedup that measured accept lengths would buy.

The pieces of a random-weight model with DeepSeek-V3's layer dimensions (``deepseek_v3_layers.py``, bf16: one dense
layer, one MoE layer, the output head) are timed against tree size (nodes per request, 1..128) at each batch size
(1..64), after a 1024-token cache. The full model's verify time is composed from them as DeepSeek-V3 stacks its
layers: 3 dense + 58 MoE layers + the head; one draft level is the MTP layer (an MoE layer) plus the head over a
level of 8 nodes. That makes one ``CostCurve`` per batch size, and ``predicted_speedup`` (which charges a step by
``step_seconds``, the project's one step cost) turns accept lengths into speedups:

* the accept lengths measured per (head, temperature, policy, budget, depth) in docs/results/acceptance.json;
* the best Sequoia tree under each shipped acceptance profile (``choose_tree_size``).

The fused step's own kernels are not charged (step_overhead 0): ``bench/kernels.py`` times them separately.

    python bench/verify_cost.py                    # CUDA GPU: about a minute, ~40 GiB of GPU memory
    python bench/verify_cost.py --tiny             # any machine: tiny dimensions (checks the harness; no timing)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from deepseek_v3_layers import DEEPSEEK_V3, TINY, ModelDims, VerifyModel, weight_bytes
from harness import REPO, device_name, environment

from sglang_spec.decode.autotune import interleaved_medians
from sglang_spec.errors import exit_status
from sglang_spec.files import check_output_path, read_text, write_json_atomic
from sglang_spec.models.loading import SHIPPED_PROFILES
from sglang_spec.costs import CostCurve, predicted_speedup
from sglang_spec.tree.sizing import choose_tree_size
from sglang_spec.tree.profile import AcceptanceProfile

ACCEPTANCE = REPO / "docs" / "results" / "acceptance.json"
PROFILES = REPO / "sglang_spec" / "data" / "profiles"
POLICIES = ("chain", "eagle", "sequoia", "specexec")
DRAFT_LEVEL_NODES = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64,128", help="tree nodes per request (root included)")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--prefix", type=int, default=1024, help="cached context tokens per request")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "verify-cost.json")
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions and sizes on any device (CPU: float32)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.batch_sizes, args.prefix, args.repeats = "1,2,4,8", "1,2", 16, 2
    return args


# ------------------------------------------------------------------------------------------------ timing
@torch.no_grad()
def measure_pieces(model: VerifyModel, batch: int, nodes: int, prefix: int, repeats: int, device: str) -> dict:
    """Seconds of each piece's forward over ``batch`` requests x ``nodes`` tree tokens after ``prefix`` (medians,
    CUDA events on a GPU; the pieces taken in turn)."""
    x = torch.randn(batch, nodes, model.dims.hidden, device=device, dtype=model.head.dtype)
    pieces = {
        "dense_layer_s": lambda: model.dense(x, model.cache, prefix),
        "moe_layer_s": lambda: model.moe(x, model.cache, prefix),
        "head_s": lambda: model.logits(x),
    }
    return {"batch": batch, "nodes": nodes, **interleaved_medians(pieces, repeats, device=device)}


def full_model_seconds(dims: ModelDims, piece: dict) -> float:
    """A verify forward of the whole model: its dense and MoE layers as DeepSeek-V3 stacks them, plus the head."""
    return (dims.dense_layers * piece["dense_layer_s"] + (dims.layers - dims.dense_layers) * piece["moe_layer_s"]
            + piece["head_s"])


def cost_curves(dims: ModelDims, pieces: list[dict], prefix: int, device_name: str) -> dict[int, CostCurve]:
    """batch -> CostCurve: verify[n] of the whole model; a draft level = one MoE (MTP) layer + head over 8 nodes
    (the nearest measured size); the fused step's own kernels are not charged (step_overhead 0)."""
    curves = {}
    for batch in sorted({piece["batch"] for piece in pieces}):
        rows = {piece["nodes"]: piece for piece in pieces if piece["batch"] == batch}
        level = rows[min(rows, key=lambda nodes: abs(nodes - DRAFT_LEVEL_NODES))]
        curves[batch] = CostCurve(
            verify={nodes: full_model_seconds(dims, row) for nodes, row in sorted(rows.items())},
            draft_level=level["moe_layer_s"] + level["head_s"], step_overhead=0.0, prefix=prefix,
            device=device_name)
    return curves


# ------------------------------------------------------------------------------------------------ speedups
def measured_accept_lengths(path: Path = ACCEPTANCE) -> list[dict]:
    """The tree rows of the acceptance sweep: head, temperature, method, budget, depth, accept_length."""
    rows = json.loads(read_text(path, "acceptance results"))["rows"]
    keys = ("head", "temperature", "method", "budget", "depth", "accept_length")
    return [{key: row[key] for key in keys} for row in rows
            if row["method"] in POLICIES and row["budget"] > 0 and math.isfinite(row["accept_length"])]


def speedups(curves: dict[int, CostCurve], accepted: list[dict]) -> list[dict]:
    """One row per (batch, measured tree configuration): what its accept length buys at this verify cost."""
    return [{"batch": batch, **row,
             "speedup": predicted_speedup(curve, row["accept_length"], row["budget"] + 1, row["depth"])}
            for batch, curve in curves.items() for row in accepted]


def profile_choices(curves: dict[int, CostCurve], max_depth: int = 8) -> list[dict]:
    """The best Sequoia tree under each shipped acceptance profile, per batch (budgets: measured sizes - 1)."""
    rows = []
    for head, files in SHIPPED_PROFILES.items():
        for temperature, file in files.items():
            profile = AcceptanceProfile.load(PROFILES / file)
            for batch, curve in curves.items():
                choice = choose_tree_size(profile, curve, max_depth=max_depth)
                rows.append({"batch": batch, "profile": file, "head": head, "temperature": temperature,
                             **asdict(choice)})
    return rows


def print_report(dims: ModelDims, curves: dict[int, CostCurve], gains: list[dict], choices: list[dict],
                 experts: str) -> None:
    batches = sorted(curves)
    sizes = sorted(next(iter(curves.values())).verify)
    shape = "DeepSeek-V3" if dims == DEEPSEEK_V3 else "tiny"
    print(f"\nverify forward of a {dims.layers}-layer {shape}-dimension model, ms (experts: {experts})")
    print("  batch | " + " ".join(f"{n:>8}" for n in sizes))
    for batch in batches:
        print(f"  {batch:>5} | " + " ".join(f"{curves[batch].verify[n] * 1e3:8.2f}" for n in sizes))
    print(f"\npredicted speedup at this verify cost (accept lengths measured with SmolLM2-135M and the shipped heads,"
          f" {ACCEPTANCE.relative_to(REPO)}): the best measured tree per batch size")
    groups = sorted({(row["head"], row["temperature"]) for row in gains})
    print("  head     T    | " + " | ".join(f"{'batch ' + str(batch):<19}" for batch in batches))
    for head, temperature in groups:
        cells = []
        for batch in batches:
            best = max((row for row in gains if (row["head"], row["temperature"], row["batch"]) ==
                        (head, temperature, batch)), key=lambda row: row["speedup"])
            cells.append(f"{best['speedup']:5.2f}x {best['method']:<8} {best['budget']:<3}")
        print(f"  {head:<8} {temperature:<4} | " + " | ".join(f"{cell:<19}" for cell in cells))
    print("\nbest Sequoia tree under each shipped profile (budget/depth: speedup)")
    for profile in sorted({row["profile"] for row in choices}):
        cells = [f"bs {row['batch']}: {row['budget']}/{row['depth']} {row['speedup']:.2f}x"
                 for row in choices if row["profile"] == profile]
        print(f"  {profile}: " + ", ".join(cells))


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_output_path(args.out, force=True)  # a bad --out fails now, not after the sweep
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print("bench/verify_cost.py times a DeepSeek-V3-sized forward and there is no CUDA device here; run it on a "
              "GPU, or pass --tiny to check the harness on tiny dimensions")
        return 2
    dims = TINY if args.tiny else DEEPSEEK_V3
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    sizes = [int(n) for n in args.sizes.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        # weights, plus attention scores and logits at the largest point (bf16 and fp32 copies)
        peak = max(batches) * max(sizes) * (dims.heads * (args.prefix + max(sizes)) * 8 + dims.vocab * 4)
        need = weight_bytes(dims) + peak
        if free < need:
            print(f"error: needs ~{need / 2**30:.0f} GiB of GPU memory and {free / 2**30:.0f} GiB are free; pass "
                  f"smaller --batch-sizes / --sizes or free the GPU")
            return 3  # bench/gpu_check.py: cannot run on this machine (skipped, not failed)
    started = time.perf_counter()
    model = VerifyModel(dims, device, dtype, max(batches), args.prefix + max(sizes))
    experts = model.experts.choose_implementation()
    # one pass at the largest point first: clocks up, allocator pools and kernels ready before anything counts
    measure_pieces(model, max(batches), max(sizes), args.prefix, 1, device)
    pieces = []
    for batch in batches:
        for nodes in sizes:
            pieces.append(measure_pieces(model, batch, nodes, args.prefix, args.repeats, device))
    curves = cost_curves(dims, pieces, args.prefix, device_name(device))
    gains = speedups(curves, measured_accept_lengths())
    choices = profile_choices(curves)
    print_report(dims, curves, gains, choices, experts)
    report = {
        "environment": environment(device_name(device), dtype=str(dtype).replace("torch.", "")),
        "dims": asdict(dims), "prefix": args.prefix, "tiny": args.tiny, "experts": experts,
        "seconds": time.perf_counter() - started,
        "pieces": pieces,
        "cost_curves": {str(batch): curve.to_json() for batch, curve in curves.items()},
        "accept_lengths_from": str(ACCEPTANCE.relative_to(REPO)),
        "speedups": gains,
        "profile_choices": choices,
    }
    write_json_atomic(args.out, report)
    print(f"\nwrote {args.out}" + ("  (tiny: harness check, not DeepSeek-V3 timings)" if args.tiny else ""))
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
