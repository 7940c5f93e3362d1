"""``SGLangServer.start`` (``sglang_spec_testbed/server.py``) against stand-in launchers: it reads only what the log
gained since its last poll, so a bind failure written in two pieces across polls must still be seen, and a launcher that
dies is reported with its last error line, and one that dies on a taken port is a port race (start again);
``stop(wait=False)`` returns before the group has gone, and a thread ends it; a SIGTERM to the caller stops the
servers it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from sglang_spec.errors import SpecError
from sglang_spec_testbed import server


def launcher(tmp_path, body: str):
    """A stand-in for ``python``: ``start`` runs ``<it> -m sglang.launch_server ...``, and it runs ``body``."""
    path = tmp_path / "fake_python.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_bind_failure_written_across_two_polls_is_seen(tmp_path, monkeypatch):
    # the message's two halves land in different polls; the process lingers as uvicorn's does
    halves = ("ERROR: [Errno 98] error while attempting to bind: addr", "ess already in use")
    body = f"printf '%s' '{halves[0]}'\nsleep {4 * server.START_POLL_S}\nprintf '%s\\n' '{halves[1]}'\nsleep 60\n"
    monkeypatch.setattr(sys, "executable", launcher(tmp_path, body))
    started = time.monotonic()
    with pytest.raises(server.PortTaken, match="^port 1 was taken between free_port"):
        server.SGLangServer(["--port", "1"], 1, tmp_path / "server.log", env={}, cpu=False).start(timeout=30)
    assert time.monotonic() - started < 10


def test_a_launcher_that_dies_on_a_taken_zmq_port_is_a_port_race(tmp_path, monkeypatch):
    # SGLang's own ZMQ ports race other processes as uvicorn's does, but the scheduler dies rather than lingers;
    # the test below is the control (another death is not a port race)
    body = "echo \"zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5757')\"\nexit 1\n"
    monkeypatch.setattr(sys, "executable", launcher(tmp_path, body))
    with pytest.raises(server.PortTaken, match=r"^a port of this server was taken .*ZMQError: Address already"):
        server.SGLangServer([], 1, tmp_path / "server.log", env={}, cpu=False).start(timeout=30)


def test_a_launcher_that_dies_on_its_busy_metrics_port_is_a_port_race(tmp_path, monkeypatch):
    # SGLang checks the ports it derives from --port (the metrics port) and dies when another process holds one
    body = ("echo \"ValueError: metrics_port at 54264 is not available in 30 seconds. metrics_port is used by a "
            "process already.\"\nexit 1\n")
    monkeypatch.setattr(sys, "executable", launcher(tmp_path, body))
    with pytest.raises(server.PortTaken, match=r"^a port of this server was taken .*metrics_port at 54264"):
        server.SGLangServer([], 1, tmp_path / "server.log", env={}, cpu=False).start(timeout=30)


def test_a_launcher_that_dies_is_reported_with_its_last_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", launcher(tmp_path, "echo 'ValueError: no such model'\nexit 3\n"))
    with pytest.raises(SpecError, match=r"exited with status 3 during start-up \(ValueError: no such model\)"):
        server.SGLangServer([], 1, tmp_path / "server.log", env={}, cpu=False).start(timeout=30)


def test_a_stop_without_waiting_returns_at_once_and_a_thread_ends_the_group(tmp_path):
    # a launcher that takes its time over SIGTERM, as SGLang's does (its watchdog looks every 5 s)
    ready = tmp_path / "trapped"  # written once the trap is set: a SIGTERM before it would end the shell at once
    process = subprocess.Popen(["sh", "-c", f"trap 'sleep 2; exit 0' TERM; touch {ready}; sleep 60 & wait; sleep 2"],
                               start_new_session=True)
    deadline = time.monotonic() + 20
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    stand_in = server.SGLangServer([], 1, tmp_path / "server.log", env={}, cpu=False)
    stand_in.process = process
    server._RUNNING[process.pid] = process
    started = time.monotonic()
    stand_in.stop(wait=False)
    assert time.monotonic() - started < 0.5 and process.poll() is None
    deadline = time.monotonic() + 20
    while process.pid in server._RUNNING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process.poll() is not None and not server._group_alive(process.pid)


CALLER = """
import subprocess, sys, time
from sglang_spec_testbed import server
child = subprocess.Popen(["sleep", "120"], start_new_session=True)  # a server: its own session, as start() makes it
server._RUNNING[child.pid] = child
if sys.argv[1] == "handler":
    server.exit_on_sigterm()
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("handler", [True, False])
def test_a_sigterm_to_the_caller_stops_its_servers(handler):
    """``kill`` of a benchmark or test that started servers stops them; the control, without the handler,
    leaves the server running (what the handler is for)."""
    caller = subprocess.Popen([sys.executable, "-c", CALLER, "handler" if handler else "none"],
                              stdout=subprocess.PIPE, text=True)
    child = int(caller.stdout.readline())
    try:
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=30) == (128 + signal.SIGTERM if handler else -signal.SIGTERM)
        deadline = time.monotonic() + 10
        while server._group_alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server._group_alive(child) is not handler
    finally:
        if server._group_alive(child):
            os.kill(child, signal.SIGKILL)
