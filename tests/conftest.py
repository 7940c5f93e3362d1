"""Test-session set-up. Runs before any project, transformers or sglang module is imported:

* TRITON_INTERPRET=1 must be set before a @triton.jit function is defined, or it stays a compiled kernel that
  cannot launch without a GPU driver;
* no hub access, ever (HF_HUB_OFFLINE=1);
* a torchvision stand-in on sys.path (the PyPI wheels are CUDA builds that break `import transformers` here).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_HAS_CUDA_ENV = os.environ.get("SGLANG_SPEC_TEST_GPU") == "1"
if not _HAS_CUDA_ENV:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS_DIR = Path(__file__).resolve().parent
DATA_DIR = TESTS_DIR / "data"


def _torchvision_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


if not _torchvision_importable() or os.environ.get("SGLANG_SPEC_TORCHVISION_STUB", "1") == "1":
    sys.path.insert(0, str(TESTS_DIR / "_stubs"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _require_sglang():
    """sglang must be importable where the set-up script ran (CI); elsewhere its tests skip."""
    try:
        import sglang  # noqa: F401
    except ImportError:
        if os.environ.get("SGLANG_SPEC_REQUIRE_SGLANG") == "1":
            raise
        pytest.skip("sglang is not installed")


@pytest.fixture(scope="session")
def sglang_kernels():
    _require_sglang()
    from sglang_oracles import SGLangTreeKernels

    return SGLangTreeKernels()


@pytest.fixture(scope="session")
def sglang_eagle():
    _require_sglang()
    from sglang_oracles import SGLangEagleSelection

    return SGLangEagleSelection()
