"""This machine's limits for one decode step, beside what the decoder achieves.

    python bench/limits.py                      # SmolLM2 fp32, 300-token context
    python bench/limits.py --model tiny-deepseek --context 64

Measures memory bandwidth (a read of a tensor far larger than the caches) and matmul throughput (float32 GEMM, the
largest square one and the model's own shapes), then derives floors: a plain decode step must read every weight
once (bytes / bandwidth); a verify of n tree tokens must also do 2 * n * params of multiply-adds (flops /
throughput), so its floor is the larger of the two. Beside the floors: the runner's measured plain step and
verify of n tree tokens at the given context (the decoder's runner: ``decode/static_runner.py`` where the model
allows). Timings are medians of rounds that take the forwards in turn; run on a quiet machine (the script prints
the 1-minute load before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from harness import LIMIT_SIZES, markdown_table, median_seconds, random_tree

from sglang_spec.catalog import load_model
from sglang_spec.decode.autotune import interleaved_medians
from sglang_spec.errors import SpecError, exit_status
from sglang_spec.files import check_output_path, write_text_atomic
from sglang_spec.decode.static_runner import target_runner_for
from sglang_spec.tree.batch import TreeBatch


def memory_bandwidth(megabytes: int = 512) -> float:
    """GB/s of a streaming read (a sum over a tensor far larger than the last-level cache)."""
    data = torch.ones(megabytes * 2**20 // 4)
    seconds = median_seconds(lambda: data.sum(), repeats=7, warmup=2)
    return data.numel() * 4 / seconds / 1e9


def matmul_throughput(rows: int, inner: int, cols: int, matrices: int = 1) -> float:
    """GFLOP/s of float32 ``[rows, inner] @ [inner, cols]^T`` (``matrices`` distinct weights in turn, so a
    weight-streaming case is not served from cache)."""
    inputs = torch.randn(rows, inner)
    weights = [torch.randn(cols, inner) for _ in range(matrices)]

    def run() -> None:
        for weight in weights:
            torch.nn.functional.linear(inputs, weight)

    seconds = median_seconds(run, repeats=7, warmup=2)
    return 2 * rows * inner * cols * matrices / seconds / 1e9


@dataclass
class ModelShape:
    weight_bytes: int  # bytes one forward must read (every matmul weight once; the tied output head counted once)
    matmul_params: int  # multiply-adds per token in the weight matmuls
    layers: int
    hidden: int
    kv_width: int  # keys + values per token and layer (attention cost grows with the context)
    heads: int
    head_dim: int

    def flops(self, tokens: int, context: int) -> float:
        """float32 operations of a forward over ``tokens`` new tokens after ``context`` cached ones."""
        attention = 4 * self.layers * self.heads * self.head_dim * tokens * (context + tokens)
        return 2.0 * self.matmul_params * tokens + attention


def model_shape(model: Any) -> ModelShape:
    config = model.config
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings().weight
    params = 0
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2 and parameter is not embedding:
            params += parameter.numel()
    if output is embedding:  # tied: the output head is a matmul over the embedding table
        params += output.numel()
    element = embedding.element_size()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(weight_bytes=params * element, matmul_params=params, layers=config.num_hidden_layers,
                      hidden=config.hidden_size, kv_width=2 * kv_heads * head_dim, heads=heads, head_dim=head_dim)


def measure(model: Any, context: int, sizes: tuple[int, ...] = LIMIT_SIZES, repeats: int = 9,
            quick: bool = False) -> dict[str, Any]:
    """The runner's plain step and verify(n) at a ``context``-token cache, with the machine's floors (``quick``:
    a smaller bandwidth read and GEMM, for tests)."""
    load_before = os.getloadavg()[0]
    bandwidth = memory_bandwidth(128 if quick else 512)
    gemm = 512 if quick else 2048
    peak = matmul_throughput(gemm, gemm, gemm)
    shape = model_shape(model)
    hidden = shape.hidden
    intermediate = getattr(model.config, "intermediate_size", 4 * hidden)
    shaped = {n: matmul_throughput(n, hidden, intermediate, matrices=64) for n in (1, 16)}
    runner = target_runner_for(model)
    prompt = torch.randint(model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    prefill = runner.prefill(prompt)

    def plain_step() -> None:
        runner.decode_one(5, context, prefill.cache)  # rewrites slot `context`: the cache stays `context` long

    runner.start_batch([runner.prefill(prompt)])
    forwards: dict[Any, Callable[[], object]] = {"plain": plain_step}
    for size in sizes:
        batch = TreeBatch.from_trees([random_tree(size, model.config.vocab_size)])
        # a verify writes its nodes past the committed slots and commits nothing: repeatable as is
        forwards[size] = lambda batch=batch: runner.verify(batch)
    timed = interleaved_medians(forwards, repeats, warmup=2)
    plain = timed.pop("plain")
    verify = timed
    memory_floor = shape.weight_bytes / (bandwidth * 1e9)
    floors = {n: max(memory_floor, shape.flops(n, context) / (peak * 1e9)) for n in sizes}
    return {
        "runner": type(runner).__name__,
        "threads": torch.get_num_threads(),
        "context": context,
        "memory_bandwidth_gbs": bandwidth,
        "matmul_peak_gflops": peak,
        "matmul_peak_size": gemm,
        "matmul_model_shape_gflops": {str(n): v for n, v in shaped.items()},
        "model": asdict(shape),
        "plain_step_seconds": plain,
        "plain_step_floor_seconds": memory_floor,
        "verify_seconds": {str(n): t for n, t in verify.items()},
        "verify_floor_seconds": {str(n): t for n, t in floors.items()},
        "verify16_over_plain": verify.get(16, float("nan")) / plain,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def render(limits: dict[str, Any]) -> str:
    lines = [
        f"Machine: {limits['threads']} thread(s); memory bandwidth "
        f"{limits['memory_bandwidth_gbs']:.1f} GB/s (streaming "
        f"read), float32 matmul {limits['matmul_peak_gflops']:.0f} GFLOP/s "
        f"({limits.get('matmul_peak_size', 2048)}^3), "
        + ", ".join(f"{v:.1f} GFLOP/s at {n} token(s) x the MLP weights" for n, v in
                    limits["matmul_model_shape_gflops"].items())
        + f". Load (1 min) {limits['load_before']:.2f} before, {limits['load_after']:.2f} after.",
        "",
        f"Model: {limits['model']['weight_bytes'] / 1e6:.1f} MB of weights read per forward, "
        f"{limits['model']['matmul_params'] / 1e6:.1f} M multiply-adds per token; runner {limits['runner']}, "
        f"{limits['context']}-token context.",
        "",
    ]
    plain = limits["plain_step_seconds"]
    rows = [["plain decode step", f"{limits['plain_step_floor_seconds'] * 1e3:.1f}", f"{plain * 1e3:.1f}",
             f"{plain / limits['plain_step_floor_seconds']:.2f}", "1.00"]]
    for size, seconds in limits["verify_seconds"].items():
        floor = limits["verify_floor_seconds"][size]
        rows.append([f"verify {size} tree tokens", f"{floor * 1e3:.1f}", f"{seconds * 1e3:.1f}",
                     f"{seconds / floor:.2f}", f"{seconds / plain:.2f}"])
    lines += markdown_table(["forward", "floor (ms)", "measured (ms)", "measured / floor", "/ plain step"], rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    try:  # a bad --out fails now, not after the measurements
        if args.out is not None:
            check_output_path(args.out, force=True)
        if args.context < 16:
            raise SpecError(f"--context must be >= 16, got {args.context}")
    except SpecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    with torch.no_grad():
        limits = measure(loaded.model, args.context)
    print(render(limits))
    if args.out is not None:
        write_text_atomic(args.out, json.dumps(limits, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))  # bad input found after the options (a model that does not load) is one line too
