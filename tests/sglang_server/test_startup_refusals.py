"""What a launch that cannot work says: one ``error:`` line and a non-zero exit, before any worker starts, and no
traceback. Each case runs the real ``python -m sglang.launch_server`` (through the CPU harness) to the point of
refusal."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_spec_testbed import server_environment
from sglang_spec_testbed.server import cpu_launch_args, free_port

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


def launch(model, extra: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "sglang.launch_server", *cpu_launch_args(model, free_port(), extra=extra)]
    return subprocess.run(command, env=server_environment(), capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize(
    "extra, message",
    [
        # Sequoia's DP tree for budget 31 / depth 6 / topk 4 expands 5 nodes at depth 2: wider than width 4
        (["--speculative-tree-policy", "sequoia", "--speculative-tree-budget", "31", "--speculative-tree-depth", "6",
          "--speculative-tree-topk", "4", "--speculative-tree-width", "4", "--speculative-acceptance-profile",
          "{profile}"], "--speculative-tree-width must be at least 5"),
        (["--speculative-tree-policy", "eagle", "--speculative-tree-budget", "8", "--enable-multi-layer-eagle"],
         "--enable-multi-layer-eagle runs its own draft worker"),
        (["--speculative-tree-policy", "eagle", "--speculative-tree-budget", "8", "--attention-backend",
          "torch_native"], "attention-backend torch_native cannot run tree speculation"),
        (["--speculative-tree-budget", "8"], "--speculative-tree-budget needs --speculative-tree-policy"),
        (["--speculative-tree-policy", "eagle", "--speculative-tree-budget", "8", "--speculative-adaptive"],
         "--speculative-adaptive changes the draft step count"),
        # specexec 16/3/2 (width = budget 16): the loop can use 2 + 4 + 8 = 14 draft slots
        (["--speculative-tree-policy", "specexec", "--speculative-tree-budget", "16", "--speculative-tree-depth", "3",
          "--speculative-tree-topk", "2"], "exceeds the 14 draft tokens"),
    ],
    ids=["infeasible-sequoia-plan", "multi-layer-eagle", "backend-without-trees", "budget-without-policy",
         "adaptive-steps", "specexec-beyond-usable-slots"],
)
def test_refused_with_one_line(smollm2_cpu, extra, message):
    extra = [part.replace("{profile}", str(smollm2_cpu.profile)) for part in extra]
    finished = launch(smollm2_cpu, extra)
    errors = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    assert finished.returncode != 0
    assert len(errors) == 1 and message in errors[0], finished.stderr[-2000:]
    assert "Traceback" not in finished.stderr + finished.stdout


def test_a_bad_fused_accept_kernels_name_is_one_line(smollm2_cpu, monkeypatch):
    from sglang_spec.sglang_plugin.fused_accept import ACCEPT_KERNELS_ENV

    monkeypatch.setenv(ACCEPT_KERNELS_ENV, "cuda")
    finished = launch(smollm2_cpu, ["--speculative-tree-policy", "eagle", "--speculative-tree-budget", "8",
                                    "--speculative-tree-accept", "fused"])
    errors = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    assert finished.returncode != 0
    assert len(errors) == 1 and f"{ACCEPT_KERNELS_ENV}='cuda' names no fused-accept kernels" in errors[0], \
        finished.stderr[-2000:]
    assert "Traceback" not in finished.stderr + finished.stdout


@pytest.mark.parametrize("variable, value, message", [
    ("SGLANG_SPEC_CPU_GEMM", "blas", "is not a GEMM backend"),
    ("SGLANG_SPEC_CPU_DRAFT_WEIGHTS", "fp8", "is not a draft weight dtype"),
    ("SGLANG_SPEC_CPU_PREFILL_THREADS", "0", "is not a thread count"),
])
def test_a_bad_setting_of_the_cpu_bed_is_one_line(smollm2_cpu, monkeypatch, variable, value, message):
    from sglang_spec_testbed.linear import DRAFT_WEIGHTS_ENV, GEMM_ENV
    from sglang_spec_testbed.threads import PREFILL_THREADS_ENV

    assert variable in (GEMM_ENV, DRAFT_WEIGHTS_ENV, PREFILL_THREADS_ENV)  # the names the bed reads
    monkeypatch.setenv(variable, value)
    finished = launch(smollm2_cpu, [])
    errors = [line for line in finished.stderr.splitlines() if line.startswith("error: ")]
    assert finished.returncode != 0
    assert len(errors) == 1 and f"{variable}={value!r} {message}" in errors[0], finished.stderr[-2000:]
    assert "Traceback" not in finished.stderr + finished.stdout
