"""``sglang_spec_testbed/zygote.py``: which environments share a zygote, and a forked launch that fails the way
``python -m sglang.launch_server`` fails (status and last error line) with its output in the server's log. The forked
launches that serve are every test under ``tests/sglang_server`` (``running_server``)."""

from __future__ import annotations

import pytest

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.faults import ACCEPT_FAULT_ENV, FAULT_ENV, FAULT_RANK_ENV, HEAD_POISON_ENV
from sglang_spec_testbed import THREADS_BIND_ENV, linear, patches, step_timing, server, server_environment
from sglang_spec_testbed import tree_mask, zygote
from sglang_spec.sglang_plugin.fused_accept import ACCEPT_KERNELS_ENV


def test_late_variables_are_left_out_of_the_key_and_the_rest_kept():
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    late = {name: "1" for name in (FAULT_ENV, ACCEPT_FAULT_ENV, FAULT_RANK_ENV, HEAD_POISON_ENV,
                                   patches.OVERLAP_ENV, step_timing.PROFILE_ENV, step_timing.CPROFILE_ENV,
                                   THREADS_BIND_ENV, ACCEPT_KERNELS_ENV, "PYTEST_CURRENT_TEST")}
    assert zygote.import_key({**base, **late}) == zygote.import_key(base)
    # read by the bed's sitecustomize while a launcher starts (before the fork): a zygote of their own
    for early in (tree_mask.TREE_MASK_ENV, linear.GEMM_ENV, linear.DRAFT_WEIGHTS_ENV, "OMP_NUM_THREADS"):
        assert zygote.import_key({**base, early: "other"}) != zygote.import_key(base), early


def test_a_zygote_refuses_an_environment_with_another_key(tmp_path):
    env = server_environment()
    keeper = zygote.zygote_for(env)
    with pytest.raises(SpecError, match="another environment"):
        keeper.spawn(["--help"], {**env, tree_mask.TREE_MASK_ENV: "full"}, tmp_path / "log")


def test_a_forked_launch_fails_as_an_executed_one_does(tmp_path):
    """No model path: SGLang's argument parser ends the launcher. Both launchers report the same exit status and
    error line, and the forked one's output is in its log after the command line."""
    messages = {}
    for launcher in server.LAUNCHERS:
        log = tmp_path / f"{launcher}.log"
        with pytest.raises(SpecError, match="during start-up") as raised:
            server.SGLangServer(["--port", "1"], 1, log, launcher=launcher).start(timeout=120)
        messages[launcher] = str(raised.value).split("; its log:")[0]
        lines = log.read_text().splitlines()
        assert lines[0].startswith("$ ") and "sglang.launch_server --port 1" in lines[0]
        assert len(lines) > 1
    assert messages["fork"] == messages["exec"], messages


def test_an_unknown_launcher_is_one_line(tmp_path):
    with pytest.raises(SpecError, match=r"^launcher 'spawn': choose one of exec, fork$"):
        server.SGLangServer([], 1, tmp_path / "log", launcher="spawn")


def test_a_forked_launcher_forks_sglangs_children_with_fresh_signal_handlers():
    """SGLang asks for ``spawn``; the launcher forks instead, and a forked child has the handlers the launcher had
    before SGLang installed its own (a spawned child's: the interpreter's defaults)."""
    import subprocess
    import sys

    program = """
import multiprocessing, signal
from sglang_spec_testbed import zygote
zygote._fork_sglang_children()
multiprocessing.set_start_method("spawn", force=True)
signal.signal(signal.SIGCHLD, lambda *args: None)  # as SGLang's launcher does before it starts its children

def report(queue):
    queue.put((multiprocessing.get_start_method(), signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL))

queue = multiprocessing.SimpleQueue()
child = multiprocessing.Process(target=report, args=(queue,))
child.start()
child.join()
print(*queue.get())
"""
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["fork", "True"]
