"""A launcher process that has imported ``sglang.launch_server`` once and forks one launcher per server start.

Every ``python -m sglang.launch_server`` on this CPU spends 5-11 s importing torch and sglang before its first log
line (a fifth of a start here; the test suite starts ~60 servers). A ``Zygote`` is a helper process, started with
a server's environment, that imports the launcher's modules and then waits; each start forks it, and the child
(in a session of its own, output to the server's log, the server's environment and arguments) runs
``sglang.launch_server`` as ``__main__`` exactly as ``python -m`` does: SGLang's plugins load there, after the fork.
Its scheduler and detokenizer processes are forked from the launcher too (SGLang asks for ``spawn``; the launcher
turns it into ``fork``, ``_fork_sglang_children``): they start with the modules the zygote imported (the HTTP
server's imports take in the scheduler's) and the plugins the launcher loaded, instead of importing torch and sglang
again (about half of a start here). Imports are shared only between starts whose environments agree on everything
read while importing (``import_key``); the variables the bed reads later (fault injection, the overlap loop,
profiles, thread binding, the accept kernels) may differ.

``SGLangServer(..., launcher="fork")`` uses it (the test suite's servers); benchmarks and users start
``python -m sglang.launch_server`` directly. The child is the zygote's, not the caller's: ``ForkedProcess`` gives
the caller the part of ``subprocess.Popen`` the server harness uses, the zygote reaping the child and reporting its
exit status.

Protocol (one JSON object a line on the zygote's stdin / stdout, one request answered before the next is sent):
``{"op": "spawn", "args", "env", "log", "cwd"}`` -> ``{"pid"}``; ``{"op": "poll", "pid"}`` -> ``{"returncode"}``
(null while it runs; Popen's convention: minus the signal number when a signal ended it).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import runpy
import select
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Mapping, Sequence

from sglang_spec.errors import SpecError
from sglang_spec_testbed import THREADS_BIND_ENV, patches, step_timing
from sglang_spec.sglang_plugin.fused_accept import ACCEPT_KERNELS_ENV

LAUNCHER_MODULE = "sglang.launch_server"
# what the launcher imports before its first log line (launch_server's own imports and its HTTP server's)
PRELOAD = (LAUNCHER_MODULE, "sglang.srt.entrypoints.http_server")
# environment variables the bed reads only after the launcher's ``__main__`` starts (in the plugin's registration,
# which SGLang runs there, or in the spawned scheduler): servers that differ in these alone share a zygote
LATE_PREFIXES = ("SGLANG_SPEC_INJECT_", "PYTEST_")
LATE_VARIABLES = frozenset({patches.OVERLAP_ENV, step_timing.PROFILE_ENV, step_timing.CPROFILE_ENV, THREADS_BIND_ENV,
                            ACCEPT_KERNELS_ENV})
MAX_ZYGOTES = 2  # zygotes kept at once (each holds ~0.6 GB of imported modules); the least recently used goes
POLL_S = 0.05  # ForkedProcess.wait: how often the zygote is asked
ANSWER_TIMEOUT_S = 60.0  # a spawn or poll answer (a fork takes milliseconds; the zygote does nothing else)
UNKNOWN_EXIT = -1  # a child's exit status once its zygote is gone (reaped by init)


def import_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of a server's environment that the launcher's imports may read: two environments with the same key
    can share a zygote."""
    return tuple(sorted((name, value) for name, value in env.items()
                        if name not in LATE_VARIABLES and not name.startswith(LATE_PREFIXES)))


class Zygote:
    """One helper process (``python -m sglang_spec_testbed.zygote`` under ``env``) and its children."""

    def __init__(self, env: Mapping[str, str], timeout: float = 120.0) -> None:
        self.key = import_key(env)
        self._lock = threading.Lock()
        self._pending = b""  # answer bytes read past the last full line
        self.process = subprocess.Popen([sys.executable, "-m", __name__], env=dict(env), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        ready = self._read(timeout)
        if ready.get("ready") is not True:
            self.close()
            raise SpecError(f"the launcher zygote did not start ({ready.get('error')})")

    def _read(self, timeout: float) -> dict:
        """The zygote's next answer. When it exits or says nothing for ``timeout`` seconds the zygote is closed (an
        answer arriving late would be read as the next one's) and SpecError raised."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 65536) if ready else None
            if not chunk:
                self.close()
                raise SpecError("the launcher zygote " + (f"said nothing for {timeout:.0f} s" if chunk is None
                                                          else f"exited with status {self.process.returncode}"))
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        with self._lock:
            if self.process.poll() is not None:
                raise SpecError(f"the launcher zygote exited with status {self.process.returncode}")
            assert self.process.stdin is not None
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                self.close()
                raise SpecError(f"the launcher zygote exited with status {self.process.returncode}") from None
            answer = self._read(ANSWER_TIMEOUT_S)
        if "error" in answer:
            raise SpecError(f"the launcher zygote refused {request['op']}: {answer['error']}")
        return answer

    def spawn(self, args: Sequence[str], env: Mapping[str, str], log_path: Path) -> ForkedProcess:
        """A launch_server with ``args`` under ``env`` (whose ``import_key`` must be this zygote's), its output
        appended to ``log_path``."""
        if import_key(env) != self.key:
            raise SpecError("this zygote imported under another environment; start a zygote for this one")
        answer = self._ask({"op": "spawn", "args": list(args), "env": dict(env), "log": str(log_path),
                            "cwd": os.getcwd()})
        return ForkedProcess(self, int(answer["pid"]), [sys.executable, "-m", LAUNCHER_MODULE, *args])

    def returncode(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})["returncode"]

    def close(self) -> None:
        """Ends the zygote (its children, in sessions of their own, are left to their callers)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


class ForkedProcess:
    """A launcher forked by a zygote, with the part of ``subprocess.Popen`` that ``SGLangServer`` uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.zygote.returncode(self.pid)
            except SpecError:  # the zygote is gone (its children pass to init, which reaps them): alive or not
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    self.returncode = UNKNOWN_EXIT
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass


_ZYGOTES: dict[tuple[tuple[str, str], ...], Zygote] = {}  # by import key, least recently used first


def zygote_for(env: Mapping[str, str]) -> Zygote:
    """The zygote for ``env``'s import key, started on first use (its start is the import a launcher would do)."""
    key = import_key(env)
    zygote = _ZYGOTES.pop(key, None)
    if zygote is None or zygote.process.poll() is not None:
        while len(_ZYGOTES) >= MAX_ZYGOTES:
            _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
        zygote = Zygote(env)
    _ZYGOTES[key] = zygote
    return zygote


@atexit.register
def close_zygotes() -> None:
    for zygote in _ZYGOTES.values():
        zygote.close()
    _ZYGOTES.clear()


# ---------------------------------------------------------------------------------------------- the zygote side
def _answer(fd: int, message: dict) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")


def _requests(fd: int):
    """Lines from ``fd``, read unbuffered: a forked child must not inherit requests read ahead."""
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        yield json.loads(line)


def _run_launcher(request: dict, channel: tuple[int, int], started: int) -> None:
    """In the forked child: becomes ``python -m sglang.launch_server <args>`` under the request's environment, with
    stdin from /dev/null and stdout / stderr appended to the log. Exits through ``SystemExit`` (atexit handlers
    and multiprocessing's clean-up run as at a normal interpreter exit). Signal handlers are Python's defaults: the
    zygote sets none."""
    os.setsid()
    os.write(started, b"1")  # the caller may signal the child's group from now on
    for fd in (*channel, started):
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    module_file = importlib.util.find_spec(LAUNCHER_MODULE).origin
    sys.argv = [module_file, *request["args"]]
    sys.path[0] = request["cwd"]  # python -m puts the working directory first
    _fork_sglang_children()
    code: int | str | None = 0
    try:
        runpy.run_module(LAUNCHER_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)


def _fork_sglang_children() -> None:
    """In the launcher: SGLang's ``mp.set_start_method("spawn", force=True)`` chooses ``fork`` instead, so its
    scheduler and detokenizer processes start from this launcher's imports. A spawned child starts with an
    interpreter's default signal handlers; a forked one would inherit those SGLang's launcher installs before it
    starts them (SIGCHLD, SIGQUIT: the launcher's process-tree clean-up), so each forked child gets the handlers
    this launcher had before SGLang ran."""
    import multiprocessing
    import signal

    fresh = {number: handler for number in signal.valid_signals()
             if number not in (signal.SIGKILL, signal.SIGSTOP) and (handler := signal.getsignal(number)) is not None}

    def restore_handlers() -> None:
        for number, handler in fresh.items():
            signal.signal(number, handler)

    os.register_at_fork(after_in_child=restore_handlers)
    choose = multiprocessing.set_start_method

    def fork_for_spawn(method: str | None, force: bool = False) -> None:
        choose("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = fork_for_spawn  # type: ignore[assignment]


def _serve() -> None:
    """The zygote's loop: imports the launcher's modules, says ready, then forks on each spawn and reaps on each
    poll. Its protocol runs on fds moved off 0 / 1 (the imports' prints go nowhere)."""
    requests_fd, answers_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)
    try:
        for module in PRELOAD:
            importlib.import_module(module)
    except BaseException as error:  # noqa: BLE001 (the caller's SpecError names it)
        _answer(answers_fd, {"ready": False, "error": f"{type(error).__name__}: {error}"})
        return
    _answer(answers_fd, {"ready": True})
    finished: dict[int, int] = {}
    for request in _requests(requests_fd):
        if request["op"] == "spawn":
            sys.stdout.flush()
            sys.stderr.flush()
            started_read, started_write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(started_read)
                _run_launcher(request, (requests_fd, answers_fd), started_write)
            os.close(started_write)
            os.read(started_read, 1)  # its own session first: the pid is also the group the caller stops
            os.close(started_read)
            _answer(answers_fd, {"pid": pid})
        elif request["op"] == "poll":
            pid = int(request["pid"])
            if pid not in finished:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    _answer(answers_fd, {"error": f"pid {pid} is not a child of this zygote"})
                    continue
                if done:
                    finished[pid] = os.waitstatus_to_exitcode(status)
            _answer(answers_fd, {"returncode": finished.get(pid)})
        else:
            _answer(answers_fd, {"error": f"unknown op {request['op']!r}"})


if __name__ == "__main__":
    _serve()
