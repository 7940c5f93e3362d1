"""``python -m sglang.launch_server`` on this CPU: the argument list for a small model, and the process itself.

``cpu_launch_args`` names everything a CPU launch needs (model and draft folders, ``intel_amx`` attention,
float32, no CUDA graphs, a small KV pool). ``SGLangServer`` starts the launcher in its own process group, waits
for ``/health`` with a hard timeout, and stops the whole group (scheduler and detokenizer subprocesses
included) by signal, escalating to SIGKILL, so no process outlives it; an ``atexit`` handler stops any server a
crashed caller left running, and a SIGTERM to the caller (``kill``, a timeout) runs that handler too.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from sglang_spec.catalog import resolve_model_path
from sglang_spec.errors import SpecError
from sglang_spec.models.cache_dir import build_lock
from sglang_spec.models.loading import shipped_head_path, shipped_profile_path
from sglang_spec_testbed import server_environment, zygote
from sglang_spec_testbed.split_heads import pad_attention_heads
from sglang_spec.sglang_plugin.export import TOKEN_MAP, export_llama_draft

CPU_FLAGS = ("--device", "cpu", "--attention-backend", "intel_amx", "--dtype", "float32",
             "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
             "--mem-fraction-static", "0.3", "--max-total-tokens", "8192", "--max-running-requests", "8",
             "--random-seed", "0")
CPU_MODELS = ("smollm2", "smollm2-split", "tiny-deepseek")
SPLIT_KEY_VALUE_HEADS = 4  # smollm2-split: SmolLM2 padded to 12 query / 4 KV heads, which split over 2 or 4 ranks
# speculative algorithms that take the model's draft arguments (the MTP head / layer); others run without them
DRAFT_MODEL_ALGORITHMS = ("NEXTN", "EAGLE")


@dataclass(frozen=True)
class CpuModel:
    """A model the CPU server can serve with speculation: the target folder and the draft arguments
    (``--speculative-draft-model-path`` / ``--speculative-token-map``; empty for a checkpoint with its own MTP
    layer, which SGLang's NEXTN finds by itself)."""

    name: str
    target_dir: Path
    draft_args: tuple[str, ...]
    profile: Path | None  # the acceptance profile shipped with the head (sequoia), when there is one
    model_args: tuple[str, ...] = ()  # launch arguments the model itself needs


def prepare_model(name: str, progress: bool = True) -> CpuModel:
    """Builds or converts the model on first use (cached) and, for SmolLM2, exports its shipped MTP head as an
    SGLang draft folder beside it."""
    if name not in CPU_MODELS:
        raise SpecError(f"unknown CPU model {name!r}; choose one of {', '.join(CPU_MODELS)}")
    if name == "smollm2-split":
        return _split_model(prepare_model("smollm2", progress))
    _, target_dir = resolve_model_path(name, progress=progress)
    if name == "tiny-deepseek":
        # a toy vocabulary without a tokenizer: requests carry token ids
        return CpuModel(name, target_dir, (), None, model_args=("--skip-tokenizer-init",))
    head = shipped_head_path(name)
    if head is None:
        raise SpecError(f"no MTP head is shipped for {name}")
    export = export_llama_draft(head, target_dir, target_dir.parent / f"{target_dir.name}-sglang-draft")
    return CpuModel(name, target_dir, tuple(export.server_args()), shipped_profile_path(name))


def _split_model(model: CpuModel) -> CpuModel:
    """SmolLM2 with zero attention heads appended (``split_heads``), target and draft: the same target outputs,
    and ``--tp-size 2`` serves it. Its draft proposes over the whole vocabulary (no ``--speculative-token-map``),
    as R1's MTP layer does: SGLang cuts a token map's rows out of the target's output head as if it were whole,
    which under tensor parallelism it is not (each rank holds a slice of the vocabulary). The padded target is
    built once (cached beside the original); the draft is padded again on every call, as the head's export is
    rewritten on every call."""
    target_dir = model.target_dir.parent / f"{model.target_dir.name}-split"
    if not (target_dir / ".complete").exists():
        with build_lock(target_dir):
            if not (target_dir / ".complete").exists():
                pad_attention_heads(model.target_dir, target_dir, SPLIT_KEY_VALUE_HEADS)
                (target_dir / ".complete").write_text(f"{model.target_dir.name} padded to {SPLIT_KEY_VALUE_HEADS} "
                                                      f"KV heads\n")
    draft_source = Path(option_value(model.draft_args, "--speculative-draft-model-path") or "")
    draft_dir = pad_attention_heads(draft_source, target_dir.parent / f"{target_dir.name}-sglang-draft",
                                    SPLIT_KEY_VALUE_HEADS, skip=(TOKEN_MAP,))
    return CpuModel("smollm2-split", target_dir, ("--speculative-draft-model-path", str(draft_dir)), model.profile,
                    model.model_args)


def option_value(args: Sequence[str], *flags: str) -> str | None:
    """The value ``args`` (a launch_server argument list) gives an option spelt as any of ``flags`` (its name and
    aliases), as ``--flag value`` or ``--flag=value``; the last one in ``args`` wins, as in SGLang's argparse
    parser. None when absent."""
    value = None
    for index, arg in enumerate(args):
        name, equals, inline = arg.partition("=")
        if name not in flags:
            continue
        if equals:
            value = inline
        elif index + 1 < len(args):
            value = args[index + 1]
    return value


# launch_server's parallel sizes whose product is the scheduler processes it starts, each with its spellings (the
# abbreviations ``--tp`` / ``--dp`` are argparse's unique prefixes; ``--pp`` is ambiguous there, so not one)
PARALLEL_SIZE_FLAGS = (("--tp-size", "--tp", "--tensor-parallel-size"), ("--dp-size", "--dp", "--data-parallel-size"),
                       ("--pp-size", "--pipeline-parallel-size"))


def launch_ranks(args: Sequence[str]) -> int:
    """The scheduler processes a launch_server argument list starts: its tensor-, data- and pipeline-parallel
    sizes multiplied (each 1 when absent), SGLang's ``dp_size * tp_size * pp_size`` world of the CPU engine's
    per-rank NUMA check (``numa_utils.init_threads_binding``)."""
    ranks = 1
    for flags in PARALLEL_SIZE_FLAGS:
        value = option_value(args, *flags)
        ranks *= int(value) if value is not None else 1
    return ranks


def cpu_launch_args(model: CpuModel, port: int, speculative: bool = True, extra: Sequence[str] = ()) -> list[str]:
    """Arguments for ``python -m sglang.launch_server``; ``extra`` (any launch_server options) goes last.

    ``speculative``: NEXTN with the model's MTP draft, unless ``extra`` names another ``--speculative-algorithm``:
    EAGLE gets the same draft arguments, an algorithm without a draft model (NGRAM: SGLang's n-gram corpus, tuned
    by its own ``--speculative-ngram-*`` / ``--speculative-num-draft-tokens`` options) none. False: plain
    decoding, and an algorithm in ``extra`` is a contradiction (SpecError)."""
    args = ["--model-path", str(model.target_dir), "--host", "127.0.0.1", "--port", str(port), *CPU_FLAGS,
            *model.model_args]
    algorithm = option_value(extra, "--speculative-algorithm")
    if not speculative:
        if algorithm is not None:
            raise SpecError(f"--speculative-algorithm {algorithm} asks for speculation on a server launched without "
                            "it (--no-speculation / speculative=False); drop one of the two")
    elif algorithm is None:
        args += ["--speculative-algorithm", "NEXTN", *model.draft_args]
    elif algorithm.upper() in DRAFT_MODEL_ALGORITHMS:
        args += model.draft_args
    return args + list(extra)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(process: subprocess.Popen | zygote.ForkedProcess, timeout: float) -> None:
    """SIGTERM to the launcher alone (it shuts its scheduler and detokenizer down itself; signalling them too
    makes it wait out crash diagnostics); after ``timeout``, SIGKILL to the whole group for whatever is left.
    The launcher is reaped here (a zombie would keep its group alive)."""
    pgid = process.pid
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    deadline = time.monotonic() + 10.0
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


PORT_TAKEN = "address already in use"  # a bind failure in the server's log, lower-cased: uvicorn's, ZMQ's, gloo's
PORT_BUSY = "is used by a process already"  # SGLang's own check of a port it derives (the metrics port), lower-cased
START_POLL_S = 0.25  # start-up: how often the process, the log and /health are checked (a launch takes ~25 s here)


class PortTaken(SpecError):
    """The port ``free_port`` gave was taken before the server bound it (another process won the race): start
    again on a new port."""


LAUNCHERS = ("exec", "fork")
# launchers started by this process and not yet stopped
_RUNNING: dict[int, subprocess.Popen | zygote.ForkedProcess] = {}


@atexit.register
def _stop_leftovers() -> None:
    for process in list(_RUNNING.values()):
        _stop(process, 5.0)
    _RUNNING.clear()


def exit_on_sigterm() -> None:
    """A SIGTERM to this process exits it through ``SystemExit``, so ``_stop_leftovers`` runs: Python's default
    action ends the process at once, and the servers (each in its own session) would keep their schedulers
    running, slowing whatever runs next. Installed from the main thread over the default action only (a caller's
    own handler stays)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))


class SGLangServer:
    """A launch_server process group. Use as a context manager, or ``start()`` / ``stop()``."""

    def __init__(self, args: Sequence[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                 cpu: bool = True, launcher: str = "exec") -> None:
        """``cpu``: run through the CPU harness (``server_environment``); False for a GPU host, where ``env``
        (default: this process's environment) is used as is. ``launcher``: ``exec`` starts ``python -m
        sglang.launch_server``; ``fork`` forks it from a process that has imported the launcher's modules under the
        same environment, and SGLang's scheduler and detokenizer from it (``zygote``: about half a start saved; the
        test suite's servers)."""
        if launcher not in LAUNCHERS:
            raise SpecError(f"launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
        self.launcher = launcher
        self.args = list(args)
        self.port = port
        self.log_path = Path(log_path)
        self.env = (server_environment(env, ranks=launch_ranks(self.args)) if cpu
                    else dict(os.environ if env is None else env))
        self.process: subprocess.Popen | zygote.ForkedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> SGLangServer:
        """Starts the server and waits until ``/health`` answers; raises SpecError (with the log's tail) when the
        process dies or the timeout passes, after stopping whatever it started. Starting a running server is an
        error: a second launcher on the same port would leak the first one."""
        if self.process is not None and self.process.poll() is None:
            raise SpecError(f"this SGLang server (pid {self.process.pid}) is already running; use it as a context "
                            "manager or call start() once")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        command = [sys.executable, "-m", zygote.LAUNCHER_MODULE, *self.args]
        log.write("$ " + " ".join(command) + ("  (forked from a launcher zygote)" if self.launcher == "fork" else "")
                  + "\n")
        log.flush()
        if self.launcher == "fork":
            log.close()
            self.process = zygote.zygote_for(self.env).spawn(self.args, self.env, self.log_path)
        else:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
            log.close()
        _RUNNING[self.process.pid] = self.process
        exit_on_sigterm()
        deadline = time.monotonic() + timeout
        read, tail = 0, ""  # bytes of the log already searched; the end of them (a match across two reads)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                log_tail = self.log_tail(200).lower()
                if PORT_TAKEN in log_tail or PORT_BUSY in log_tail:  # a port SGLang derives, raced the same way
                    raise PortTaken(f"a port of this server was taken between its choice and its bind "
                                    f"({self.last_error()}); its log: {self.log_path}")
                raise SpecError(f"the SGLang server exited with status {self.process.returncode} during start-up "
                                f"({self.last_error()}); its log: {self.log_path}")
            with self.log_path.open("rb") as log_file:  # only what was written since the last poll
                log_file.seek(read)
                new = log_file.read()
            read += len(new)
            text = tail + new.decode(errors="replace").lower()
            tail = text[-len(PORT_TAKEN):]
            if PORT_TAKEN in text:  # uvicorn logs it and lingers
                self.stop()
                raise PortTaken(f"port {self.port} was taken between free_port() and the server's bind; its log: "
                                f"{self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(START_POLL_S)
        self.stop()
        raise SpecError(f"the SGLang server did not answer /health within {timeout:.0f} s "
                        f"({self.last_error()}); its log: {self.log_path}")

    def stop(self, timeout: float = 8.0, wait: bool = True) -> None:
        """Stops the server's process group (``_stop``). ``wait=False`` returns at once and leaves the stop to a
        thread: SGLang's launcher looks for SIGTERM every 5 s, and an idle server has nothing to drain, so a caller
        that goes on to start another server need not wait for it (the test suite; whatever is still running at
        exit is stopped then)."""
        if self.process is None:
            return
        process = self.process

        def finish() -> None:
            _stop(process, timeout)
            _RUNNING.pop(process.pid, None)

        if wait:
            finish()
        else:
            threading.Thread(target=finish, name=f"stop-sglang-{process.pid}", daemon=True).start()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def last_error(self) -> str:
        """The log's last line naming an error (a traceback's final line, usually), for a one-line message."""
        lines = self.log_tail(200).splitlines()
        for line in reversed(lines):
            if "Error" in line or "error:" in line or "Exception" in line:
                return line.strip()[:300]
        return lines[-1].strip()[:300] if lines else "no log"

    def __enter__(self) -> SGLangServer:
        """Starts the server unless ``start()`` already did."""
        if self.process is None or self.process.poll() is not None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ requests
    def request(self, path: str, payload: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
        """POST ``payload`` as JSON to ``path`` (GET when None); the decoded JSON answer, or the text. A server
        that does not answer within ``timeout`` raises ``TimeoutError`` with its log's last lines (a hung step's
        last log lines are what tell a hang from a slow machine)."""
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read().decode()
        except TimeoutError as error:
            raise TimeoutError(f"{path} did not answer within {timeout:.0f} s; the server's log ends:\n"
                               f"{self.log_tail(40)}") from error
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: dict[str, Any] | list[dict[str, Any]], timeout: float = 600.0
                 ) -> list[dict[str, Any]]:
        """One batched /generate call; ``prompts`` as text, or token ids; ``sampling_params`` for every prompt, or
        one a prompt. Returns SGLang's answers in order."""
        key = "text" if isinstance(prompts[0], str) else "input_ids"
        answer = self.request("/generate", {key: list(prompts), "sampling_params": sampling_params},
                              timeout=timeout)
        return answer if isinstance(answer, list) else [answer]
