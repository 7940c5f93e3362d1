"""``PackedLinear``'s backends side by side at a decode step's and a tree verify's row counts, over SmolLM2-shaped
weights: F.linear, MKL packed GEMMs and the project's AVX-512 kernel (``gemm/small_gemm.py``).

    python bench/packed_gemm.py                 # rows 1, 4, 8, 16, 17, 32; 2 threads

Random float32 weights with SmolLM2-135M's shapes (30 layers of fused q/k/v, o, gate/up and down, plus the
49152 x 576 output head: 538 MB, far past the caches), one product per weight; the backends take passes in turn
and each keeps its best of 5. Prints one line per row count: milliseconds per backend (a PackedLinear prepared
for exactly that many rows); a backend this machine lacks prints "-".
"""

from __future__ import annotations

import argparse

import torch

from sglang_spec.decode.autotune import interleaved_times
from sglang_spec.gemm.packed_linear import BACKENDS, PackedLinear, available_backends

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of qkv, o, gate_up, down
LAYERS = 30
HEAD = (49152, 576)


def best_pass_ms(backends: dict[str, list[tuple[object, torch.Tensor]]], passes: int = 5) -> dict[str, float]:
    """Best pass per backend, the backends' passes interleaved (so a slow spell of the machine hits them all)."""

    def one_pass(products: list[tuple[object, torch.Tensor]]) -> None:
        for product, x in products:
            product(x)  # type: ignore[operator]

    passes_by_backend = {name: (lambda products=products: one_pass(products)) for name, products in backends.items()}
    times = interleaved_times(passes_by_backend, passes, warmup=0)
    return {name: min(seconds) * 1e3 for name, seconds in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,17,32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    available = available_backends()
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(*shape, generator=generator) * 0.02 for _ in range(LAYERS) for shape in LAYER_SHAPES]
    weights.append(torch.randn(*HEAD, generator=generator) * 0.02)
    names = list(reversed(BACKENDS))  # linear, mkl, avx512
    print("rows | " + " | ".join(f"{name} (ms)" for name in names))
    for rows in (int(part) for part in args.rows.split(",")):
        inputs = {inner: torch.randn(rows, inner, generator=generator) for inner in {w.shape[1] for w in weights}}
        backends = {}
        for name in names:
            if name not in available:
                continue
            products = []
            for weight in weights:
                product = PackedLinear(weight, name)
                product.prepare(rows)
                products.append((product, inputs[weight.shape[1]]))
            backends[name] = products
        timed = best_pass_ms(backends)
        cells = [f"{timed[name]:.1f}" if name in timed else "-" for name in names]
        print(f"{rows:4d} | " + " | ".join(cells), flush=True)
        del backends  # each backend's packs are about the weights' size
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
