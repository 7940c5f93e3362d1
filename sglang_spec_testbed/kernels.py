"""A stand-in for sgl-kernel's CPU build: the ``sgl_kernel`` module and the ``torch.ops.sgl_kernel`` namespace.

SGLang reaches sgl-kernel three ways: ``from sgl_kernel import name`` (often inside ``try``), ``hasattr`` probes,
and ``torch.ops.sgl_kernel.name(...)`` calls. Each name resolves to one of:

* a stand-in from ``STAND_INS`` (the ops SGLang calls on the paths we serve);
* a placeholder that raises when called, for the names in ``IMPORTED_ONLY``: imported unconditionally at module
  import time by code that never calls them here;
* nothing (``AttributeError`` / ``ImportError``), so a probe sees a build without that op and takes its
  fallback, exactly as with a real build that lacks it.
"""

from __future__ import annotations

import sys
import types
from typing import Callable

import torch

from sglang_spec_testbed import attention, linear, ops

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


class NotOnThisPath:
    """A name SGLang imports but must not call on the paths the CPU harness serves."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.default = self

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{self.name} has no CPU stand-in in sglang_spec's harness; this model or option is not "
            f"supported on the CPU test bed"
        )


def resolve(name: str):
    if name in STAND_INS:
        return STAND_INS[name]
    if name in IMPORTED_ONLY:
        return NotOnThisPath(name)
    raise AttributeError(f"sgl_kernel CPU stand-in has no {name}")


class _Namespace(types.ModuleType):
    """``sgl_kernel`` and its sub-modules: every attribute goes through ``resolve``."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return resolve(name)


class _OpsNamespace:
    """``torch.ops.sgl_kernel``; each stand-in also answers ``.default`` like an OpOverloadPacket."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        function = resolve(name)
        if not hasattr(function, "default"):
            function.default = function  # type: ignore[attr-defined]
        return function


def install() -> None:
    """Puts the fake ``sgl_kernel`` package in ``sys.modules`` and on ``torch.ops``."""
    package = _Namespace("sgl_kernel")
    package.__path__ = []  # type: ignore[attr-defined]  # a package, so sub-module imports resolve
    package.__version__ = "0.0.0+sglang_spec_cpu"  # type: ignore[attr-defined]
    sys.modules["sgl_kernel"] = package
    for name in SUBMODULES:
        module = _Namespace(f"sgl_kernel.{name}")
        module.__path__ = []  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module
        setattr(package, name, module)
    torch.ops.sgl_kernel = _OpsNamespace()  # type: ignore[attr-defined]
