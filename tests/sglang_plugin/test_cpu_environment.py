"""The environment the CPU bed gives every SGLang process (``cpu.server_environment``): glibc's malloc thresholds
fixed, so a decode step's large temporaries stay in the heap (``MALLOC_ENV``), and a caller's own values kept."""

from __future__ import annotations

from sglang_spec.sglang_plugin.cpu import MALLOC_ENV, server_environment


def test_malloc_thresholds_are_fixed_and_a_callers_own_win():
    env = server_environment({})
    assert {name: env[name] for name in MALLOC_ENV} == MALLOC_ENV
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) <= 32 << 20  # glibc ignores a larger mmap threshold
    # no trim of a step's temporaries
    assert int(env["MALLOC_TRIM_THRESHOLD_"]) > int(env["MALLOC_MMAP_THRESHOLD_"])
    mine = server_environment({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert mine["MALLOC_TRIM_THRESHOLD_"] == "0"
    assert mine["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
