"""A stand-in for sgl-kernel: the ``sgl_kernel`` module and the ``torch.ops.sgl_kernel`` namespace, in two modes.
``install("cpu")`` (the CPU test bed) stands in for sgl-kernel's CPU build; ``install("cuda")`` for its CUDA build on
a GPU machine that has none (``cuda_kernels``: the names SGLang's CUDA server paths import, in torch).

SGLang reaches sgl-kernel three ways: ``from sgl_kernel import name`` (often inside ``try``), ``hasattr`` probes,
and ``torch.ops.sgl_kernel.name(...)`` calls. Each name resolves to one of:

* a stand-in from ``STAND_INS`` (the ops SGLang calls on the paths we serve);
* a placeholder that raises when called, for the names in ``IMPORTED_ONLY``: imported unconditionally at module
  import time by code that never calls them here;
* nothing (``AttributeError`` / ``ImportError``), so a probe sees a build without that op and takes its
  fallback, exactly as with a real build that lacks it.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Callable

import torch

from sglang_spec.errors import SpecError
from sglang_spec_testbed import attention, cuda_kernels, linear, ops

STAND_INS: dict[str, Callable] = {**ops.STAND_INS, **attention.STAND_INS, **linear.STAND_INS}

IMPORTED_ONLY = frozenset({
    "rotate_input_ids_cpu",
    "causal_conv1d_fn_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
})

# sub-modules SGLang imports from (``from sgl_kernel.speculative import ...``)
SUBMODULES = ("allreduce", "attention", "elementwise", "flash_attn", "gemm", "kvcacheio", "mamba", "moe",
              "quantization", "sampling", "spatial", "speculative", "top_k", "utils")


ASKED: set[str] = set()  # every name asked of the module (``sgl_kernel.utils.x``), found or not: the import audit

MODES = {"cpu": (STAND_INS, IMPORTED_ONLY, SUBMODULES),
         "cuda": (cuda_kernels.STAND_INS, cuda_kernels.IMPORTED_ONLY, cuda_kernels.SUBMODULES)}


class NotOnThisPath:
    """A name SGLang imports but must not call on the paths the stand-in serves."""

    def __init__(self, name: str, mode: str = "cpu") -> None:
        self.name = name
        self.mode = mode
        self.default = self

    def __call__(self, *args, **kwargs):
        where = "the CPU test bed" if self.mode == "cpu" else "a GPU machine without sgl-kernel"
        raise NotImplementedError(
            f"sgl_kernel.{self.name} has no {self.mode.upper()} stand-in in sglang_spec's harness; this model or "
            f"option is not supported on {where}"
        )


def resolve(name: str, mode: str = "cpu"):
    stand_ins, imported_only, _ = MODES[mode]
    if name in stand_ins:
        return stand_ins[name]
    if name in imported_only:
        return NotOnThisPath(name, mode)
    raise AttributeError(f"sgl_kernel {mode.upper()} stand-in has no {name}")


class _Namespace(types.ModuleType):
    """``sgl_kernel`` and its sub-modules: every attribute goes through ``resolve`` in the module's mode."""

    mode = "cpu"

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        ASKED.add(f"{self.__name__}.{name}")
        return resolve(name, self.mode)


class _OpsNamespace:
    """``torch.ops.sgl_kernel``; each stand-in also answers ``.default`` like an OpOverloadPacket."""

    def __init__(self, mode: str = "cpu") -> None:
        self.mode = mode

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        function = resolve(name, self.mode)
        if not hasattr(function, "default"):
            function.default = function  # type: ignore[attr-defined]
        return function


def _module(name: str, mode: str) -> _Namespace:
    module = _Namespace(name)
    module.mode = mode
    module.__path__ = []  # type: ignore[attr-defined]  # a package, so sub-module imports resolve
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)  # find_spec answers
    return module


def install(mode: str = "cpu") -> None:
    """Puts the fake ``sgl_kernel`` package (``mode``: cpu | cuda) in ``sys.modules`` and, for cpu, on
    ``torch.ops``."""
    if mode not in MODES:
        raise SpecError(f"sgl_kernel stand-in mode {mode!r}: choose one of {', '.join(MODES)}")
    package = _module("sgl_kernel", mode)
    package.__version__ = f"0.0.0+sglang_spec_{mode}"  # type: ignore[attr-defined]
    sys.modules["sgl_kernel"] = package
    for name in MODES[mode][2]:
        module = _module(f"sgl_kernel.{name}", mode)
        sys.modules[module.__name__] = module
        setattr(package, name, module)
    if mode == "cpu":
        torch.ops.sgl_kernel = _OpsNamespace(mode)  # type: ignore[attr-defined]
    # CUDA: ``torch.ops.sgl_kernel`` stays torch's empty namespace. SGLang calls none of it on the CUDA paths and
    # probes it with ``hasattr`` before registering fakes for sgl-kernel's compiled ops (``register_fake_if_exists``):
    # a name answered there would make torch.library look for an op that was never registered.
