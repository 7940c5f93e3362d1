"""``x @ weight.T`` at a decode step's or a tree verify's few rows on an AVX-512 CPU: a C++ kernel
(``small_gemm.cpp``), its launcher and its reference side by side.

On the 2-core AVX-512 machine this project runs on, SmolLM2-135M's weights (538 MB, streamed from memory) at 16-17
rows take 47-55 ms through ``F.linear`` and 36-41 ms through MKL's packed GEMM, and 26-33 ms here; at one row
19.5-24 ms here against 21-27 ms (``python bench/packed_gemm.py``, four runs). The weight is packed once into 32-column
panels (``pack_weight``) that serve every row count.

Panels may hold the weight rounded to bfloat16 (``pack_weight(weight, torch.bfloat16)``): the kernel widens them
in registers and multiplies in float32, the product of the rounded weight at half the memory stream. That is for
a drafter's weights, whose rounding can change which tokens it proposes but never what the target accepts.

The extension is compiled the first time it is needed (``load_small_gemm``, about 25 s with the machine's g++,
cached by PyTorch under ``~/.cache/torch_extensions``) and only where the CPU has AVX-512; elsewhere, or when the
build fails, ``load_small_gemm`` says why and callers use MKL or ``F.linear`` (``gemm/packed_linear.py``).
Results equal ``F.linear``'s up to float32 summation order.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

PANEL_COLUMNS = 32  # output columns per packed panel (the kernel's kPanel)
# torch's build lock is held for the ~25 s of a build; one this old was left by a build that was killed, and torch
# waits on it without end (a server then hangs after loading its weights)
STALE_LOCK_SECONDS = 120
_SOURCE = Path(__file__).with_name("small_gemm.cpp")
_NAME = "sglang_spec_small_gemm"


class SmallGemmUnavailable(RuntimeError):
    """The AVX-512 kernel cannot run here; the message says why in one line."""


@functools.lru_cache(maxsize=1)
def _build() -> Any:
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        raise SmallGemmUnavailable(f"the CPU's vector capability is {torch.backends.cpu.get_cpu_capability()}, "
                                   "not AVX512")
    try:
        directory: Path | None = Path(cpp_extension._get_build_directory(_NAME, verbose=False))
    except Exception:  # a private helper: only decides whether to announce the build and checks its lock
        directory = None
    lock = None if directory is None else directory / "lock"
    if lock is not None and lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        raise SmallGemmUnavailable(f"{lock} is older than {STALE_LOCK_SECONDS} s (left by a build that was "
                                   f"interrupted?) and torch would wait on it forever; delete it if no build is "
                                   f"running")
    built = None if directory is None else directory / f"{_NAME}.so"
    if built is None or not built.exists():
        print("sglang_spec: compiling the AVX-512 small-GEMM kernel (once, ~25 s) ...", file=sys.stderr, flush=True)
    try:
        return cpp_extension.load(
            name=_NAME, sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as error:  # a missing or failing compiler: say so in one line, callers fall back
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise SmallGemmUnavailable(f"building {_SOURCE.name} failed: {first_line}") from error


def load_small_gemm() -> Any:
    """The compiled extension (built on first call); raises ``SmallGemmUnavailable`` with the reason."""
    return _build()


def small_gemm_available() -> bool:
    try:
        load_small_gemm()
    except SmallGemmUnavailable:
        return False
    return True


PANEL_DTYPES = (torch.float32, torch.bfloat16)


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [N, K] float32 -> panels [ceil(N / 32), K, 32] of ``dtype`` (float32, or bfloat16: the weight
    rounded), zero padded past N, what ``small_gemm`` reads."""
    if dtype not in PANEL_DTYPES:
        raise ValueError(f"small_gemm panels are float32 or bfloat16, not {dtype}")
    out_features, in_features = weight.shape
    blocks = -(-out_features // PANEL_COLUMNS)
    padded = weight.new_zeros(blocks * PANEL_COLUMNS, in_features, dtype=dtype)
    padded[:out_features] = weight
    return padded.view(blocks, PANEL_COLUMNS, in_features).transpose(1, 2).contiguous()


def small_gemm(x: torch.Tensor, panels: torch.Tensor, out_features: int,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 CPU; panels from ``pack_weight``; residual [M, out_features] or None.
    Returns ``x @ weight.T (+ residual)`` [M, out_features], a new tensor."""
    return load_small_gemm().small_gemm(x, panels, out_features, residual)


def small_gemm_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What ``small_gemm`` computes, from the unpacked weight [N, K] and the panels' ``dtype``."""
    product = F.linear(x, weight.to(dtype).to(x.dtype))
    return product if residual is None else product + residual
