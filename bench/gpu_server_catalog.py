"""The server checks of ``scripts/gpu_check.sh`` by group: what each one serves and holds a server to
(``ServerCheck``), in running order. ``bench/gpu_server_checks.py`` runs one; ``bench/gpu_check.py`` lists them
(``SERVER_GROUPS``, ``SERVER_CHECKS``), each group's preflight first. Stdlib only at import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_server_runs import AUTO, CAPTURE, CAPTURE_FAULT_EVERY, DRAFT_FAULT_ENV, FAULTS, PLAIN, POLICY

GRAPH_BATCH_SIZES = (1, 2, 4, 8)  # decode / verify / draft CUDA graphs; 8 = --max-running-requests
FAULT_GRAPH_BATCH_SIZES = (1, 2, 4)  # fault servers: batches of 5-8 draft eagerly (below)
MAX_RUNNING = 8
DRAFT_FAULT_EVERY = 4  # with GRAPH_BATCH_SIZES (1, 2, 4), no capture is a multiple: see faults_run
ACCEPT_FAULT_EVERY = 2
ACCEPT_FAULT_ENV = "SGLANG_SPEC_INJECT_ACCEPT_FAULT"


@dataclass(frozen=True)
class ServerCheck:
    """One server-level check: ``kind`` says what it does (``run_check``); ``policy`` names a tree server of
    parity.POLICIES; ``oracle`` the plain check whose answers it is held to (same group, run first);
    ``reference`` a check whose seeded sampled answers it must equal (SGLang's accept against the fused one);
    ``model``: a folder of ``gpu_server_models.MODELS``; ``extra``: tree-server options beyond the policy's;
    ``limit``: seconds on a GPU, servers started and stopped included (an estimate: none has run on a GPU);
    ``ragged``: its trees must be verified ragged (on SGLang's ragged verify graphs where graphs are on)."""

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
    model: str = "smollm2-random-k8"
    extra: tuple[str, ...] = ()
    ragged: bool = False

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
                         "CUDA graphs, SmolLM2's architecture with random weights and an 8-token head"),
    Group("server-mla", 510, "MLA + MoE + NEXTN: the tiny DeepSeek-V3 with random weights, every head policy "
                             "against a plain server, triton attention, float32, CUDA graphs"),
    Group("server-faults", 270, "draft and accept faults injected under CUDA graphs, and a fault in a graph capture"),
    Group("server-fa3", 270, "FA3 attention on Hopper, bfloat16 (FA3 has no float32 kernels): near-ties reported"),
    Group("server-tp2", 270, "--tp-size 2 on two GPUs, greedy and seeded sampled requests, SGLang's accept and the "
                             "fused one"),
)
# every tree server's requests (tree_answers): 2 sampled (temperature 0.7, the first a server answers), 4 held-out
# chat prompts x 40 greedy tokens, 3 repeat-context prompts x 32, the first alone (batch 1), the four twice in one
# call (batch 8), the parity set as 32 concurrent requests (a stop string, max_new_tokens 1 / 2, logprobs, a
# frequency penalty, a JSON schema, a regex, n = 2, ignore_eos, a prompt 7 positions short of --context-length 512)
_REQUESTS = "sampled, held-out, repeat-context, batch 1 and 8 and 32 concurrent parity requests"
_TOKEN_REQUESTS = "sampled and greedy token-id prompts at batch 1, 4 and 8"
DEVICE_CONTEXT = ("--speculative-tree-context-on", "device")
# label -> (parity.POLICIES name, extra options, what it is)
POLICY_LABELS = {
    "chain": ("chain", (), "chain 7/7"), "eagle": ("eagle", (), "eagle 15/4/4 (SGLang's loop)"),
    "sequoia": ("sequoia", (), "sequoia 15/4/4 (own loop)"),
    "specexec": ("specexec", (), "specexec 15/4/4 (own loop, width 11 over topk 4)"),
    "hybrid": ("hybrid", (), "hybrid 12/5 (context trees grown on the host)"),
    "hybrid-device": ("hybrid", DEVICE_CONTEXT, "hybrid 12/5 grown on the device (--speculative-tree-context-on "
                                                "device: the n-gram kernel, no host read in the draft step)"),
    "lookup": ("lookup", (), "lookup 12/5 (context copies only)"),
    "sequoia-fused": ("sequoia-fused", (), "sequoia 15/4/4 with --speculative-tree-accept fused (the accept in "
                                           "the verify graph)")}


def _policy_check(name: str, group: str, label: str, oracle: str, limit: int = 120, **kwargs: Any) -> ServerCheck:
    policy, extra, shape = POLICY_LABELS[label]
    requests = _TOKEN_REQUESTS if kwargs.get("model") == "tiny-deepseek-random" else _REQUESTS
    return ServerCheck(name, group, POLICY, f"{shape}: {requests}, against {oracle}", policy=policy,
                       oracle=oracle, limit=limit, extra=extra, **kwargs)


SERVER_CHECKS = (
    ServerCheck("server_plain", "server", PLAIN, "plain decoding through launch_server (no speculation): the "
                "oracle's answers to the same requests, each also alone with its top-5 logprobs", limit=180),
    *(_policy_check(f"server_{name.replace('-', '_')}", "server", name, "server_plain",
                    limit=150 if name == "sequoia-fused" else 120,
                    reference="server_sequoia" if name == "sequoia-fused" else None)
      # most telling first (a group short of time skips its last checks); sequoia before the fused accept, whose
      # seeded sampled answers are held to sequoia's
      for name in ("sequoia", "sequoia-fused", "specexec", "hybrid", "hybrid-device", "lookup", "chain", "eagle")),
    ServerCheck("server_tree_auto", "server", AUTO, "--speculative-tree-auto over hybrid 12/5 with decode CUDA "
                "graphs: every verify size's graph state captured at start-up, the planner's steps replayed from "
                "them (sizes chosen counted from /metrics), greedy against server_plain at batch 1, 4 and 8 and 32 "
                "concurrent requests", policy="hybrid", oracle="server_plain", limit=180),
    ServerCheck("mla_plain", "server-mla", PLAIN, "plain decoding of the tiny DeepSeek-V3 (MLA, MoE): the oracle of "
                "this group", limit=150, model="tiny-deepseek-random"),
    # R1's launch first: the group's most telling check after its oracle
    ServerCheck("mla_tree_auto_ragged", "server-mla", AUTO, "--speculative-tree-auto over hybrid 12/5 on the tiny "
                "DeepSeek-V3 with --speculative-tree-mla-verify flashinfer (R1's launch) and decode CUDA graphs: "
                "each request's tree verified ragged on SGLang's ragged verify graphs (one a tier of total verify "
                "tokens; the log's line, /metrics' computed verify tokens below SGLang's width), greedy against "
                "mla_plain (triton: near-ties reported)", policy="hybrid", oracle="mla_plain", backend="flashinfer",
                model="tiny-deepseek-random", extra=("--speculative-tree-mla-verify", "flashinfer"), ragged=True,
                limit=180),
    *(_policy_check(f"mla_{name.replace('-', '_')}", "server-mla", name, "mla_plain", model="tiny-deepseek-random",
                    reference="mla_sequoia" if name == "sequoia-fused" else None)
      for name in ("sequoia", "sequoia-fused", "specexec", "chain", "eagle")),
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
