"""The server groups' first check (``bench/gpu_server_preflight.py``) and what it sets up (its dry run on this CPU:
tests/bench/test_gpu_check.py's dry run of the kit): a name nobody stands in, a missing stand-in module and an fa3
group are gaps in one line; SGLang's JIT finds the carried FlashInfer headers; the
travelling models' eight-token head and the judging's per-step times and graph counts; every server group starts
with its preflight and nothing else in it runs unless that passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_spec_testbed import cuda_host

REPO = Path(__file__).resolve().parents[2]


def test_a_name_nobody_stands_in_is_one_gap_and_an_expected_probe_is_none(bench_script):
    preflight = bench_script("gpu_server_preflight")
    gaps, kinds = preflight.name_gaps({"sgl_kernel.rmsnorm", "sgl_kernel.kvcacheio.transfer_kv_direct",
                                       "sgl_kernel.allreduce", "sgl_kernel.fancy_new_op"})
    assert gaps == ["sgl_kernel name sgl_kernel.fancy_new_op asked for and not stood in"]
    assert kinds == {"sgl_kernel.rmsnorm": "stand-in", "sgl_kernel.kvcacheio.transfer_kv_direct": "placeholder",
                     "sgl_kernel.allreduce": "absent", "sgl_kernel.fancy_new_op": "absent"}


def test_an_audit_without_the_standin_installed_is_one_gap(bench_script, monkeypatch):
    preflight = bench_script("gpu_server_preflight")
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    assert preflight.audit(dry=True)["gaps"] == [
        "the CUDA sgl_kernel stand-in is not installed in this process (boot_cuda/sitecustomize.py did not run: "
        "check PYTHONPATH)"]


def _server_process(tmp_path, headers, code):
    env = cuda_host.environment({**os.environ, "PYTHONPATH": str(REPO)}, headers)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_server_process_gets_the_standin_and_sglangs_jit_the_carried_headers(tmp_path):
    pytest.importorskip("sglang")
    include = tmp_path / "flashinfer" / "data" / "include" / "flashinfer"
    include.mkdir(parents=True)
    (include / "sampling.cuh").write_text("// header")
    done = _server_process(tmp_path, tmp_path, "import sgl_kernel, sglang.kernels.jit.utils.deps as deps; "
                           "print(sgl_kernel.__version__); print(deps.REGISTERED_DEPENDENCIES['flashinfer']())")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["0.0.0+sglang_spec_cuda", str([str(include.parent)])]
    missing = _server_process(tmp_path, tmp_path / "nowhere", "print('started')")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip() == (f"error: the CUDA sgl_kernel stand-in did not install: RuntimeError: "
                                      f"{cuda_host.HEADERS_ENV}={tmp_path / 'nowhere'} holds no "
                                      "flashinfer/data/include/flashinfer")


def test_the_k8_head_picks_one_of_its_eight_tokens_whatever_the_hidden_state(bench_script):
    models = bench_script("gpu_server_models")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(16, 100, bias=False)

    model = Model()
    active = [3, 17, 40, 41, 55, 60, 71, 99]
    models.active_head(model, active, seed=0)
    logits = model.lm_head(torch.randn(500, 16, generator=torch.Generator().manual_seed(1)))
    assert set(logits.argmax(-1).tolist()) <= set(active) and len(set(logits.argmax(-1).tolist())) > 2
    assert bool((logits.max(-1).values > 0).all())  # one of each pair is positive: never a tie among the zeros
    inactive = [token for token in range(100) if token not in active]
    assert bool((logits[:, inactive] == 0).all())


def test_step_times_and_graph_evidence(bench_script):
    judging = bench_script("gpu_server_judging")
    answers = [{"meta_info": {"e2e_latency": 0.5, "spec_verify_ct": 10, "completion_tokens": 30}},
               [{"meta_info": {"e2e_latency": 0.2, "spec_verify_ct": 4, "completion_tokens": 12}}]]
    assert judging.step_times(answers, speculative=True) == {
        "requests": 2, "seconds": 0.5, "steps": 10, "ms_per_step": 50.0, "tokens_per_second": 84.0}
    assert judging.step_times(answers, speculative=False)["ms_per_step"] == pytest.approx(1e3 * 0.5 / 30, abs=1e-3)
    log = ("Capture target verify CUDA graph end\nCapture draft decode CUDA graph end\n"
           "Decode batch, #running-req: 1, cuda graph: True\nDecode batch, #running-req: 8, cuda graph: False\n")
    evidence = judging.graph_evidence(log)
    assert evidence == {"target_graph": True, "draft_graph": True, "graph_batches": 1, "eager_batches": 1}
    assert judging.graph_problems("x", {**evidence, "graph_batches": 0}, True, False) == [
        "x: no decode batch ran in a CUDA graph (none logged 'cuda graph: True')"]


def test_every_server_group_starts_with_its_preflight_and_the_rest_needs_it(bench_script):
    gpu_check = bench_script("gpu_check")
    catalog = bench_script("gpu_server_catalog")
    from sglang_spec_testbed.parity import POLICIES

    by_name = {check.name: check for check in gpu_check.CHECKS}
    for group in catalog.SERVER_GROUPS:
        checks = [check for check in gpu_check.CHECKS if check.group == group.name]
        assert checks[0].name == gpu_check.preflight_name(group.name) and checks[0].is_preflight
        for check in checks[1:]:
            chain, seen = check, []
            while chain.after is not None:
                seen.append(chain.after)
                chain = by_name[chain.after]
            assert seen[-1] == checks[0].name, check.name
    for check in catalog.SERVER_CHECKS:
        assert check.policy is None or check.policy in POLICIES
    assert {"server_hybrid_device", "server_lookup", "server_chain", "server_sequoia_fused", "server_tree_auto",
            "mla_sequoia"} <= set(by_name)
