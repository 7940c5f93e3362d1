"""``x @ weight.T`` for a fixed weight, fast at the few rows of a decode step or a tree verify on CPU.

Three backends, the best available chosen by default (``best_backend``):

* ``avx512``: the project's AVX-512 kernel over a weight packed once into column panels (``gemm/small_gemm.py``),
  for 1 to ``MAX_SMALL_ROWS`` rows. On the 2-core AVX-512 machine this project runs on, SmolLM2's weights at 16-17
  rows take 26-33 ms against 36-41 ms on MKL's packs and 47-55 ms through ``F.linear`` (``bench/packed_gemm.py``).
* ``mkl``: MKL's packed GEMM (``cblas_sgemm_pack``, what PyTorch's inductor uses when it freezes CPU weights) for
  4-64 rows. A pack only pays at the row count it was made for (a pack for 16 rows run on 12 is slower than
  ``F.linear``), so rows are padded up to a bucket (``PACK_BUCKETS``, plus the exact row counts ``prepare`` is
  told of: a decoder names its tree size) and one pack per bucket is made the first time the bucket is used.
* ``linear``: ``F.linear``.

A ``PackedLinear`` made with ``dtype=torch.bfloat16`` multiplies by the weight rounded to bfloat16 on every backend:
``avx512`` reads bfloat16 panels (half the memory stream), the others a float32 copy of the rounded weight. That is
for a drafter's weights (``sglang_spec_testbed/linear.py``).

Anything a backend does not cover (GPU tensors, other dtypes, row counts outside its range) runs ``F.linear``.
Results equal ``F.linear``'s up to float32 summation order (``F.linear`` itself rounds differently at different
row counts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_spec.gemm.small_gemm import PANEL_DTYPES, pack_weight, small_gemm, small_gemm_available

BACKENDS = ("avx512", "mkl", "linear")
MAX_SMALL_ROWS = 64  # the avx512 backend's largest row count; a prefill's hundreds of rows run F.linear
PACK_BUCKETS = (4, 8, 16, 32, 64)  # row counts an MKL pack is made for; 1-3 rows run F.linear as fast
MAX_EXACT_BUCKET = 128  # largest row count prepare() adds as an MKL bucket of its own


def mkl_packing_available() -> bool:
    """True where PyTorch was built with MKL's packed GEMM (x86 CPU wheels)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def available_backends() -> tuple[str, ...]:
    """The backends that run here, best first (``BACKENDS``' order): ``avx512`` where the kernel builds, ``mkl``
    where PyTorch has it, ``linear`` always."""
    runs = {"avx512": small_gemm_available(), "mkl": mkl_packing_available(), "linear": True}
    return tuple(backend for backend in BACKENDS if runs[backend])


def best_backend() -> str:
    """The first of ``available_backends()``."""
    return available_backends()[0]


class PackedLinear:
    """``weight`` [out, in]; calling it on ``x`` [rows, in] returns ``x @ weight.T`` [rows, out], with the weight
    rounded to ``dtype`` first (float32: as given; bfloat16: see the module doc)."""

    def __init__(self, weight: torch.Tensor, backend: str | None = None, dtype: torch.dtype = torch.float32) -> None:
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"unknown GEMM backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if dtype not in PANEL_DTYPES:
            raise ValueError(f"a PackedLinear rounds its weight to float32 or bfloat16, not {dtype}")
        self.dtype = dtype
        self.weight = weight.detach()
        if dtype != torch.float32 and self.weight.dtype == torch.float32:
            self.weight = self.weight.to(dtype).to(torch.float32)  # what every backend multiplies by
        if self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            backend = "linear"
        self.backend = best_backend() if backend is None else backend
        self.buckets = list(PACK_BUCKETS)  # mkl: sorted; prepare() adds exact row counts
        self._packs: dict[int, torch.Tensor] = {}  # mkl: bucket -> pack
        self._panels: torch.Tensor | None = None  # avx512: pack_weight(weight)

    @property
    def packing(self) -> bool:
        return self.backend != "linear"

    def _bucket(self, rows: int) -> int | None:
        if self.backend != "mkl" or rows < PACK_BUCKETS[0]:
            return None
        for bucket in self.buckets:
            if rows <= bucket:
                return bucket
        return None

    def _pack(self, bucket: int) -> torch.Tensor:
        pack = self._packs.get(bucket)
        if pack is None:
            pack = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, bucket)
            self._packs[bucket] = pack
        return pack

    def _small_panels(self) -> torch.Tensor:
        if self._panels is None:
            self._panels = pack_weight(self.weight, self.dtype)
        return self._panels

    def prepare(self, rows: int) -> None:
        """Makes now every pack a product with up to ``rows`` rows will use, so the first one does not pay for it
        (a server's start-up, like a CUDA graph capture). mkl: also adds ``rows`` (4 to MAX_EXACT_BUCKET) as a
        bucket of its own, so a product of exactly that many rows is not padded (a 16-node tree plus its root is
        17 rows: padded to 32 it costs ~25% more)."""
        if self.backend == "avx512":
            self._small_panels()
            return
        if self.backend != "mkl":
            return
        if PACK_BUCKETS[0] <= rows <= MAX_EXACT_BUCKET and rows not in self.buckets:
            self.buckets = sorted([*self.buckets, rows])
        largest = self._bucket(rows) or (self.buckets[-1] if rows > self.buckets[-1] else 0)
        for bucket in self.buckets:
            if bucket <= largest:
                self._pack(bucket)

    def _mkl(self, x: torch.Tensor, bucket: int) -> torch.Tensor:
        pack = self._pack(bucket)
        rows = x.shape[0]
        if rows < bucket:
            x = torch.cat([x, x.new_zeros(bucket - rows, x.shape[1])])
        return torch.ops.mkl._mkl_linear(x, pack, self.weight, None, bucket)[:rows]

    def _small(self, rows: int) -> bool:
        return self.backend == "avx512" and 1 <= rows <= MAX_SMALL_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self._small(rows):
            return small_gemm(x, self._small_panels(), self.weight.shape[0])
        bucket = self._bucket(rows)
        return F.linear(x, self.weight) if bucket is None else self._mkl(x, bucket)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T`` (a new tensor; ``addmm`` where no pack is used)."""
        rows = x.shape[0]
        if self._small(rows):
            return small_gemm(x, self._small_panels(), self.weight.shape[0], residual)
        bucket = self._bucket(rows)
        if bucket is None:
            return torch.addmm(residual, x, self.weight.t())
        return self._mkl(x, bucket).add_(residual)
