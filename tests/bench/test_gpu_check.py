"""``scripts/gpu_check.sh``: the dry run passes on this CPU and lists every check, the GPU run's test selections
are not empty, what travels to a GPU machine fits its limit, and the harness's recording and time limits work."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_spec.errors import SpecError

REPO = Path(__file__).resolve().parents[2]
PAYLOAD_LIMIT = 64 * 2**20  # bytes that may travel with the repository to a bare GPU machine


def load_bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def load_gpu_check():
    return load_bench_module("gpu_check")


# the checks whose dry run is a test file the suite runs anyway (or a bench smoke run its own test makes): the
# suite's dry run leaves them out; one test-based check (head_guard_cuda_graph) still runs through pytest there
SUITE_RUNS_THEM = ("fused_accept_cuda_graph", "no_host_sync", "kernel_tests", "device_lookup", "device_hybrid",
                   "kernel_bench", "mla_tree_kernel", "mla_tree_verify_flashinfer")


@pytest.mark.slow
def test_dry_run_passes_lists_its_checks_and_appends_nothing(tmp_path):
    """Every check but SUITE_RUNS_THEM, the server groups' preflights included: the ``server`` preflight's dry run
    builds the payload's sglang, imports it with torch claiming a CUDA device and FlashInfer hidden, and resolves
    every ``sgl_kernel`` name SGLang asks for (the rest of the preflight: tests/bench/test_gpu_server_preflight.py)."""
    gpu_check = load_gpu_check()
    assert set(SUITE_RUNS_THEM) < {check.name for check in gpu_check.CHECKS}
    chosen = [check for check in gpu_check.CHECKS if check.name not in SUITE_RUNS_THEM]
    docs_before = gpu_check.DOCS.read_bytes()
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(out), "--checks",
                          ",".join(check.name for check in chosen)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    listing = run.stdout.split("\n\n", 1)[0]
    for number, check in enumerate(chosen, 1):
        assert f"{number}. {check.name}: " in listing
    results = json.loads(out.read_text())
    assert results["dry_run"] and [c["name"] for c in results["checks"]] == [c.name for c in chosen]
    statuses = {check["name"]: check["status"] for check in results["checks"]}
    assert set(statuses.values()) <= {"passed", "skipped"}
    # on a CPU only the CUDA-graph capture of the step has nothing to run; everything else ran at tiny sizes
    assert [name for name, status in statuses.items() if status == "skipped"] == ["step_cuda_graph"]
    assert gpu_check.DOCS.read_bytes() == docs_before
    assert "left as it is" in run.stdout
    preflight = next(check for check in results["checks"] if check["name"] == "server_preflight")["data"]
    assert preflight["passed"] and preflight["dry_run"]
    names = preflight["sgl_kernel_names"]
    assert names["sgl_kernel.rmsnorm"] == "stand-in" and names["sgl_kernel.utils.is_arch_support_pdl"] == "stand-in"
    assert "absent" not in names.values()
    payload = load_bench_module("gpu_server_payload")
    cache = payload.wheel_cache()
    if all(payload.cached_wheel(requirement, cache) for requirement in (payload.SGLANG, *payload.WHEELS)):
        assert "/site/sglang/" in preflight["sglang"]  # the payload's trimmed sglang, not the installed one


@pytest.mark.slow
def test_each_test_based_check_selects_tests_on_a_gpu():
    """The GPU run's selections (not the dry run's) must collect tests: a rename would silently empty a check."""
    gpu_check = load_gpu_check()
    for check in (check for check in gpu_check.CHECKS if check.is_pytest):
        run = subprocess.run([sys.executable, *check.argv, "--collect-only"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, f"{check.name}: {run.stdout[-2000:]}"


def test_payload_fits_what_a_gpu_machine_takes():
    """The git-tracked files are what travels to a bare GPU machine: at most 64 MiB."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    paths = [REPO / name for name in listed.decode().split("\0") if name]
    total = sum(path.lstat().st_size for path in paths if path.is_symlink() or path.exists())
    assert total <= PAYLOAD_LIMIT, f"tracked files take {total / 2**20:.1f} MiB, over the 64 MiB a GPU machine takes"


def test_a_bad_results_path_fails_at_once_in_one_line(tmp_path):
    """Before any check runs (a GPU run lasts minutes); the other scripts: tests/bench/test_bench_bad_out.py."""
    with pytest.raises(SpecError, match="directory"):
        load_gpu_check().main(["--dry-run", "--out", str(tmp_path)])


def test_a_check_with_a_missing_module_is_skipped_in_one_line(tmp_path):
    gpu_check = load_gpu_check()
    check = gpu_check.Check("absent", "needs a module nobody has", ("bench/kernels.py",), ("bench/kernels.py",),
                            ("no_such_module_for_gpu_check",), 10)
    outcome = gpu_check.run_check(check, dry=True, seconds_left=60, scratch=tmp_path)
    assert outcome.status == "skipped" and "no_such_module_for_gpu_check" in outcome.detail
    assert "\n" not in outcome.detail


def test_a_check_past_its_limit_is_stopped():
    gpu_check = load_gpu_check()
    code, tail = gpu_check.run_streaming([sys.executable, "-c", "print('started', flush=True); import time; "
                                          "time.sleep(60)"], dict(os.environ), timeout=2)
    assert code is None and tail == ["started"]


def test_pytest_verdicts():
    judge = load_gpu_check().judge_pytest
    assert judge(0, ["....", "12 passed, 2 skipped in 3.1s"]).status == "passed"
    skipped = judge(0, ["SKIPPED [3] tests/x.py:5: needs a CUDA GPU", "3 skipped, 6 deselected in 2.85s"])
    assert skipped.status == "skipped" and "needs a CUDA GPU" in skipped.detail
    failed = judge(1, ["FAILED tests/x.py::test_y[cuda] - AssertionError: kv0", "1 failed, 3 passed in 1.0s"])
    assert failed.status == "failed" and "test_y[cuda]" in failed.detail
    assert judge(5, ["9 deselected in 1.0s"]).status == "failed"


def test_a_run_keeps_one_row_per_device_and_check_and_escapes_pipes(tmp_path):
    gpu_check = load_gpu_check()
    outcomes = {check.name: gpu_check.Outcome("passed", "a | b", seconds=3.0) for check in gpu_check.CHECKS}
    env = {"device": "NVIDIA X"}
    rows = gpu_check.docs_rows("gpu-check.json", env, outcomes)
    assert len(rows) == len(gpu_check.CHECKS) and all(row.count(" | ") == 3 and "a \\| b" in row for row in rows)
    first = gpu_check.CHECKS[0].name
    docs = tmp_path / "log.md"
    kept = "| old.json | NVIDIA Y | `" + first + "` | **failed**: x |"
    replaced = "| old.json | NVIDIA X | `" + first + "` | **failed**: x |"
    docs.write_text("# log\n\n| record | device | check | result |\n"
                    "|---|---|---|---|\n" + kept + "\n" + replaced + "\n")
    gpu_check.record_rows(docs, rows)
    table = docs.read_text().splitlines()[2:]
    assert table[2:] == [kept, *rows]  # the other device's row kept; this device's replaced where it stood
    gpu_check.record_rows(docs, rows)
    assert docs.read_text().splitlines()[2:] == table  # a run again changes nothing
    docs.write_text("# log\n\nno table at the end\n")
    with pytest.raises(SpecError, match="does not end with its log table"):
        gpu_check.record_rows(docs, rows)


def test_groups_are_chosen_by_name_and_an_unknown_one_is_one_line(capsys):
    gpu_check = load_gpu_check()
    assert [group.name for group in gpu_check.selected_groups("server-tp2, kernels")] == ["kernels", "server-tp2"]
    with pytest.raises(SpecError, match=r"--group 'nope': choose among kernels, server, "):
        gpu_check.selected_groups("nope")
    assert gpu_check.main(["--list", "--group", "kernels"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].startswith("  [kernels]") and len(listed) == 1 + sum(
        check.group == "kernels" for check in gpu_check.CHECKS)


def test_checks_are_chosen_by_name_within_the_groups_and_an_unknown_one_is_one_line(capsys):
    """A short lease reruns what failed: ``--checks`` picks checks of the chosen groups, in running order."""
    gpu_check = load_gpu_check()
    groups = gpu_check.selected_groups("kernels,mla")
    chosen = gpu_check.selected_checks("mla_tree_kernel, kernel_bench", groups)
    assert [check.name for check in chosen] == ["kernel_bench", "mla_tree_kernel"]
    assert gpu_check.selected_checks(None, groups) == tuple(c for c in gpu_check.CHECKS
                                                            if c.group in ("kernels", "mla"))
    with pytest.raises(SpecError, match=r"--checks 'server_plain': server_plain is not a check of the groups chosen"):
        gpu_check.selected_checks("server_plain", groups)
    assert gpu_check.main(["--list", "--group", "kernels,mla", "--checks", "device_hybrid,mla_tree_kernel"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in listed if not line.startswith("  [")] == [
        "  1. device_hybrid", "  2. mla_tree_kernel"]
