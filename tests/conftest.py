"""Test-session set-up. Runs before any project, transformers or sglang module is imported:

* TRITON_INTERPRET=1 must be set before a @triton.jit function is defined, or it stays a compiled kernel that
  cannot launch without a GPU driver;
* no hub access, ever (HF_HUB_OFFLINE=1);
* a torchvision stand-in on sys.path (the PyPI wheels are CUDA builds that break `import transformers` here);
* one torch thread in each parallel worker (``scripts/test.sh`` runs the suite on pytest-xdist workers).
"""

from __future__ import annotations

import os
import sys

import pytest

from optional_packages import require_sglang
from paths import TESTS_DIR

_HAS_CUDA_ENV = os.environ.get("SGLANG_SPEC_TEST_GPU") == "1"
if not _HAS_CUDA_ENV:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # parallel workers share the cores: a torch op on two threads stalls at its barriers whenever the other worker
    # (or a server it started) is busy, so each worker's own torch runs one thread (set before torch is imported)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# converted / built models are cached inside the checkout (git-ignored): CI builds them once per run
os.environ.setdefault("SGLANG_SPEC_CACHE", str(TESTS_DIR.parent / ".cache"))


def _torchvision_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


if not _torchvision_importable() or os.environ.get("SGLANG_SPEC_TORCHVISION_STUB", "1") == "1":
    # the torchvision stand-in lives beside the CPU harness's boot files (no sglang import needed to find it)
    sys.path.insert(0, str(TESTS_DIR.parent / "sglang_spec_testbed" / "boot"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    if _HAS_CUDA_ENV and not _cuda_available():
        raise pytest.UsageError("SGLANG_SPEC_TEST_GPU=1 compiles the Triton kernels for CUDA, but torch sees no "
                                "CUDA device; unset it to run the kernels under the interpreter")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``kernel_device``: where the Triton kernels under test run. One device per process, because interpret
    mode is process-wide: "cpu" (interpreted) by default, "cuda" (compiled) with SGLANG_SPEC_TEST_GPU=1. Inputs
    are built on the CPU and moved there; references run on the CPU, so both devices meet the same ground truth."""
    if "kernel_device" in metafunc.fixturenames:
        metafunc.parametrize("kernel_device", ["cuda" if _HAS_CUDA_ENV else "cpu"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # gpu tests capture CUDA graphs of compiled kernels: interpreted kernels on a GPU would not capture
    if _HAS_CUDA_ENV and _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU and SGLANG_SPEC_TEST_GPU=1 (compiled kernels)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def sglang_kernels():
    require_sglang()
    from sglang_oracles import SGLangTreeKernels

    return SGLangTreeKernels()


@pytest.fixture(scope="session")
def sglang_eagle():
    require_sglang()
    from sglang_oracles import SGLangEagleSelection

    return SGLangEagleSelection()


@pytest.fixture(scope="session")
def tiny():
    """The toy-trained tiny DeepSeek-V3 (built once into the cache) and its distilled MTP head."""
    from sglang_spec.catalog import load_model
    from sglang_spec.models.loading import load_head_for

    loaded = load_model("tiny-deepseek", progress=False)
    return loaded, load_head_for(loaded, None)


@pytest.fixture(scope="session")
def random_tiny():
    """A random-weight tiny DeepSeek-V3 and a random MTP head (seeded): the pair bench/greedy_identity.py decodes
    with, here with the config's own vocabulary."""
    from sglang_spec.models.tiny_deepseek import random_tiny_deepseek

    return random_tiny_deepseek()


_NEAR_TIES: list[tuple[str, int]] = []
_NEAR_TIES_PROPERTY = "near_ties"


@pytest.fixture
def near_tie_report(request):
    """Greedy-identity tests append (case, excused divergences) here; the terminal summary prints them. The
    entries travel on the test's report (``user_properties``), so parallel workers' entries reach the summary."""
    entries: list[tuple[str, int]] = []
    yield entries
    request.node.user_properties.append((_NEAR_TIES_PROPERTY, entries))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for name, entries in report.user_properties:
            if name == _NEAR_TIES_PROPERTY:
                _NEAR_TIES.extend((case, count) for case, count in entries)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _NEAR_TIES:
        total = sum(count for _, count in _NEAR_TIES)
        terminalreporter.write_sep("-", f"greedy identity: {total} divergence(s) excused as near-ties (< 1e-4)")
        for case, count in _NEAR_TIES:
            if count:
                terminalreporter.write_line(f"  {case}: {count}")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in float32 (converted once into the cache) and its shipped MTP head."""
    from sglang_spec.catalog import load_model
    from sglang_spec.models.loading import load_head_for

    loaded = load_model("smollm2", progress=False)
    return loaded, load_head_for(loaded, None)


@pytest.fixture(scope="session")
def sglang_with_plugin():
    """sglang imported and ``load_plugins()`` run (our entry point discovered through the installed metadata)."""
    require_sglang()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang

    return sglang
