"""``x @ weight.T`` for a fixed weight, fast at the small row counts of a tree verify on CPU.

A float32 GEMM with 4-64 rows (a verify of a 4-64 node tree) reaches a fraction of the machine's GEMM throughput
through ``F.linear``: on the 2-core AVX-512 machine this project runs on, SmolLM2's weights at 16 rows take 48 ms
against 20 ms at one row, while the same product with the weight pre-packed by MKL for exactly 16 rows
(``cblas_sgemm_pack``, what PyTorch's inductor uses when it freezes CPU weights) takes 36 ms. A pack only pays at
the row count it was made for (a pack for 16 rows run on 12 is slower than ``F.linear``), so rows are padded up to
a bucket (``PACK_BUCKETS``, plus the exact row counts ``prepare`` is told of: a decoder names its tree size) and
one pack per bucket is made the first time the bucket is used (about the weight's size each, in 0.1-0.2 s for a
135M model).

Results equal ``F.linear``'s up to float32 summation order (``F.linear`` itself rounds differently at different
row counts). Anything else (GPU tensors, other dtypes, 1-3 rows or more than the largest bucket, a PyTorch
without MKL) runs ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_BUCKETS = (4, 8, 16, 32, 64)  # row counts a pack is made for; 1-3 rows run F.linear as fast
MAX_EXACT_BUCKET = 128  # largest row count prepare() adds as a bucket of its own


def mkl_packing_available() -> bool:
    """True where PyTorch was built with MKL's packed GEMM (x86 CPU wheels)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedLinear:
    """``weight`` [out, in]; calling it on ``x`` [rows, in] returns ``x @ weight.T`` [rows, out]."""

    def __init__(self, weight: torch.Tensor, packing: bool | None = None) -> None:
        self.weight = weight.detach()
        if packing is None:
            packing = mkl_packing_available()
        self.packing = packing and self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        self.buckets = list(PACK_BUCKETS)  # sorted; prepare() adds exact row counts
        self._packs: dict[int, torch.Tensor] = {}

    def _bucket(self, rows: int) -> int | None:
        if not self.packing or rows < PACK_BUCKETS[0]:
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

    def prepare(self, rows: int) -> None:
        """Adds ``rows`` (4 to MAX_EXACT_BUCKET) as a bucket of its own, so a product of exactly that many rows is
        not padded (a 16-node tree plus its root is 17 rows: padded to 32 it costs ~25% more), and makes now every
        pack a product with up to ``rows`` rows will use."""
        if not self.packing:
            return
        if PACK_BUCKETS[0] <= rows <= MAX_EXACT_BUCKET and rows not in self.buckets:
            self.buckets = sorted([*self.buckets, rows])
        largest = self._bucket(rows) or (self.buckets[-1] if rows > self.buckets[-1] else 0)
        for bucket in self.buckets:
            if bucket <= largest:
                self._pack(bucket)

    def _packed(self, x: torch.Tensor, bucket: int) -> torch.Tensor:
        pack = self._pack(bucket)
        rows = x.shape[0]
        if rows < bucket:
            x = torch.cat([x, x.new_zeros(bucket - rows, x.shape[1])])
        return torch.ops.mkl._mkl_linear(x, pack, self.weight, None, bucket)[:rows]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bucket = self._bucket(x.shape[0])
        return F.linear(x, self.weight) if bucket is None else self._packed(x, bucket)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ weight.T`` (a new tensor; ``addmm`` where no pack is used)."""
        bucket = self._bucket(x.shape[0])
        if bucket is None:
            return torch.addmm(residual, x, self.weight.t())
        return self._packed(x, bucket).add_(residual)
