"""F.linear against MKL packed GEMMs (``PackedLinear``) at a tree verify's row counts, over SmolLM2-shaped weights.

    python bench/packed_gemm.py                 # rows 1, 4, 8, 16, 32; 2 threads

Random float32 weights with SmolLM2-135M's shapes (30 layers of fused q/k/v, o, gate/up and down, plus the
49152 x 576 output head: 538 MB, far past the caches), one product per weight, best of 5 passes. Prints one line
per row count: milliseconds for F.linear and for a PackedLinear prepared for exactly that many rows.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from sglang_spec.decode.packed_linear import PackedLinear, mkl_packing_available

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of qkv, o, gate_up, down
LAYERS = 30
HEAD = (49152, 576)


def best_pass_ms(products: list[tuple[object, torch.Tensor]], passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for product, x in products:
            product(x)  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not mkl_packing_available():
        print("error: this PyTorch has no MKL packed GEMM")
        return 2
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(*shape, generator=generator) * 0.02 for _ in range(LAYERS) for shape in LAYER_SHAPES]
    weights.append(torch.randn(*HEAD, generator=generator) * 0.02)
    print("rows | F.linear (ms) | packed (ms)")
    for rows in (int(part) for part in args.rows.split(",")):
        inputs = {inner: torch.randn(rows, inner, generator=generator) for inner in {w.shape[1] for w in weights}}
        linear = [(lambda x, w=w: F.linear(x, w), inputs[w.shape[1]]) for w in weights]
        packed = []
        for weight in weights:
            product = PackedLinear(weight, packing=True)
            product.prepare(rows)
            packed.append((product, inputs[weight.shape[1]]))
        print(f"{rows:4d} | {best_pass_ms(linear):13.1f} | {best_pass_ms(packed):11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
