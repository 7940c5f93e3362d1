"""The environment the CPU bed gives every SGLang process (``sglang_spec_testbed.server_environment``): glibc's malloc
thresholds fixed, so a decode step's large temporaries stay in the heap (``MALLOC_ENV``), and a caller's own values
kept; one OpenMP thread a process unless ``SGLANG_SPEC_CPU_THREADS`` names a count."""

from __future__ import annotations

import pytest

from sglang_spec.errors import SpecError
from sglang_spec_testbed import MALLOC_ENV, server_environment
from sglang_spec_testbed.threads import THREADS_ENV


def test_malloc_thresholds_are_fixed_and_a_callers_own_win():
    env = server_environment({})
    assert {name: env[name] for name in MALLOC_ENV} == MALLOC_ENV
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) <= 32 << 20  # glibc ignores a larger mmap threshold
    # no trim of a step's temporaries
    assert int(env["MALLOC_TRIM_THRESHOLD_"]) > int(env["MALLOC_MMAP_THRESHOLD_"])
    mine = server_environment({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert mine["MALLOC_TRIM_THRESHOLD_"] == "0"
    assert mine["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]


def test_every_process_runs_one_thread_unless_a_count_is_named_and_a_bad_count_is_one_line():
    assert server_environment({})["OMP_NUM_THREADS"] == "1"
    assert server_environment({THREADS_ENV: " "})["OMP_NUM_THREADS"] == "1"
    assert server_environment({THREADS_ENV: "2"})["OMP_NUM_THREADS"] == "2"
    for bad in ("0", "two", "-2", "1.5"):
        with pytest.raises(SpecError, match=rf"^{THREADS_ENV}='{bad}' is not a thread count; give a positive integer") \
                as error:
            server_environment({THREADS_ENV: bad})
        assert "\n" not in str(error.value)


def test_the_cpu_launcher_refuses_a_bad_count_in_one_line_before_it_starts_a_server(monkeypatch, capsys):
    from sglang_spec_testbed import __main__ as launcher

    monkeypatch.setattr(launcher, "check_sglang_version", lambda: None)
    monkeypatch.setattr(launcher, "prepare_model", lambda name: None)
    monkeypatch.setattr(launcher, "cpu_launch_args", lambda model, port, speculative, extra: ["--port", str(port)])
    monkeypatch.setattr(launcher.os, "execve", lambda *args: pytest.fail("a server started"))
    monkeypatch.setenv(THREADS_ENV, "many")
    assert launcher.main(["--no-speculation"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: {THREADS_ENV}='many' is not a thread count; give a positive integer (2 on a 2-core "
                     f"machine of its own) or unset it"]
