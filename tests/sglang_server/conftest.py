"""SGLang's real server on this CPU (``python -m sglang.launch_server`` with our plugin and the CPU harness).

Every server a test starts runs in its own process group with a hard start-up timeout and is stopped (group
signalled, then killed) when its fixture ends; its log is checked for tracebacks, since a normal launch must
log none. Servers are module- or parameter-scoped so pytest starts each configuration once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sglang_spec.sglang_plugin.cpu.server import CpuModel, prepare_model


def _require_sglang() -> None:
    try:
        import sglang  # noqa: F401
    except ImportError:
        if os.environ.get("SGLANG_SPEC_REQUIRE_SGLANG") == "1":
            raise
        pytest.skip("sglang is not installed")


@pytest.fixture(scope="session")
def smollm2_cpu() -> CpuModel:
    _require_sglang()
    return prepare_model("smollm2", progress=False)


@pytest.fixture(scope="session")
def tiny_cpu() -> CpuModel:
    _require_sglang()
    return prepare_model("tiny-deepseek", progress=False)


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-server-logs")
