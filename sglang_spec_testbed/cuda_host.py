"""SGLang's server on a GPU machine without sgl-kernel or FlashInfer (a lent machine, ``bench/gpu_server_checks.py``):
the environment its processes get, and what ``boot_cuda/sitecustomize.py`` installs in each before sglang loads.

* the CUDA-mode ``sgl_kernel`` stand-in (``kernels.install("cuda")``, ``cuda_kernels``);
* FlashInfer's headers for SGLang's JIT: its tree-sampling kernel (``kernels/ops/speculative/sampling.py``) declares
  the ``flashinfer`` header dependency, which SGLang resolves from an installed flashinfer package; with
  ``HEADERS_ENV`` naming a folder that holds ``flashinfer/data/include`` (``bench/gpu_server_payload.py`` carries
  it), the dependency resolves to that include folder instead, and no flashinfer package is importable (SGLang
  would take its FlashInfer paths);
* ``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK`` and the Python radix-tree core (the payload drops the Rust ``.so``);
* ``CUTE_DSL_STANDINS``: SGLang's CuTe-DSL kernel modules that a Llama layer imports while it is built. They import
  ``cutlass`` (nvidia-cutlass-dsl, not carried) at module level; their kernels need SM100 (Blackwell), so on the
  lent Hopper machines the real eligibility predicates answer False, and so do the stand-ins.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.util
import os
import sys
import types
from pathlib import Path

STANDINS_ENV = "SGLANG_SPEC_CUDA_STANDINS"
HEADERS_ENV = "SGLANG_SPEC_FLASHINFER_HEADERS"
BOOT_DIR = Path(__file__).resolve().parent / "boot_cuda"
DEPS_MODULE = "sglang.kernels.jit.utils.deps"
SERVER_VARIABLES = {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}


DUAL_GEMM_MODULE = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"


class DualGemmQuantMode(enum.IntEnum):
    """SGLang 0.5.23's ``cutedsl_dual_gemm.DualGemmQuantMode``, member for member."""
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not DualGemmQuantMode.UNQUANT

    @property
    def is_dynamic(self) -> bool:
        return self in (DualGemmQuantMode.DYNAMIC_PER_TENSOR, DualGemmQuantMode.DYNAMIC_PER_TOKEN)


def _never(num_tokens: int, hidden_size: int, intermediate_size: int, quant_mode: int) -> bool:
    return False


def _needs_sm100(*args, **kwargs):
    raise RuntimeError(f"{DUAL_GEMM_MODULE} stand-in: the CuTe-DSL dual GEMM needs SM100 and nvidia-cutlass-dsl")


def dual_gemm_standin() -> types.ModuleType:
    """``DUAL_GEMM_MODULE`` as ``layers/dual_gemm.py`` uses it: ``can_use_dual_gemm`` is False (the real one requires
    SM100 first), so every Llama MLP keeps its two GEMMs; the kernels raise."""
    module = types.ModuleType(DUAL_GEMM_MODULE, "stand-in: the CuTe-DSL dual GEMM is SM100-only (cuda_host)")
    module.MAX_DUAL_GEMM_DECODE_TOKENS = 16  # type: ignore[attr-defined]
    module.DualGemmQuantMode = DualGemmQuantMode  # type: ignore[attr-defined]
    module.can_use_dual_gemm = _never  # type: ignore[attr-defined]
    module.dual_gemm_swiglu = _needs_sm100  # type: ignore[attr-defined]
    module.dual_gemm_swiglu_fp8 = _needs_sm100  # type: ignore[attr-defined]
    return module


# module name -> its stand-in, installed only where the real module cannot import (no ``cutlass``)
CUTE_DSL_STANDINS = {DUAL_GEMM_MODULE: dual_gemm_standin}


def environment(base: dict[str, str], headers: Path | None) -> dict[str, str]:
    """``base`` with the boot folder first on PYTHONPATH, the stand-in switched on, ``SERVER_VARIABLES`` and the
    FlashInfer headers folder (``headers``: holds ``flashinfer/data/include``; None: none carried)."""
    env = dict(base)
    paths = [str(BOOT_DIR)] + [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env[STANDINS_ENV] = "1"
    env.update(SERVER_VARIABLES)
    if headers is not None:
        env[HEADERS_ENV] = str(headers)
    return env


def include_paths(headers: Path) -> list[str]:
    """The include folder SGLang's JIT compiles the ``flashinfer`` dependency against; one line when absent."""
    include = headers / "flashinfer" / "data" / "include"
    if not (include / "flashinfer").is_dir():
        raise RuntimeError(f"{HEADERS_ENV}={headers} holds no flashinfer/data/include/flashinfer")
    return [str(include)]


class _DepsHook(importlib.abc.MetaPathFinder):
    """Re-registers SGLang's ``flashinfer`` JIT dependency once ``DEPS_MODULE`` has run."""

    def __init__(self, headers: Path) -> None:
        self.headers = headers

    def find_spec(self, fullname, path, target=None):
        if fullname != DEPS_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, headers = spec.loader, self.headers

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                module.REGISTERED_DEPENDENCIES["flashinfer"] = lambda: include_paths(headers)

        spec.loader = Loader()
        return spec


def install_cute_dsl_standins() -> None:
    """``CUTE_DSL_STANDINS`` into ``sys.modules`` when ``cutlass`` cannot import; nothing where it can."""
    if importlib.util.find_spec("cutlass") is None:
        for name, build in CUTE_DSL_STANDINS.items():
            sys.modules[name] = build()


def activate() -> None:
    """In a process of ``environment``: the ``sgl_kernel`` stand-in, the CuTe-DSL stand-ins where ``cutlass`` is
    absent, and the headers hook when ``HEADERS_ENV`` is set."""
    from sglang_spec_testbed import kernels

    kernels.install("cuda")
    install_cute_dsl_standins()
    headers = os.environ.get(HEADERS_ENV)
    if headers:
        include_paths(Path(headers))  # a wrong folder fails at start, not at the first sampled verify
        if DEPS_MODULE in sys.modules:
            sys.modules[DEPS_MODULE].REGISTERED_DEPENDENCIES["flashinfer"] = lambda: include_paths(Path(headers))
        else:
            sys.meta_path.insert(0, _DepsHook(Path(headers)))
