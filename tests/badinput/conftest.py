"""Hypothesis for the bad-input corpus: no example database on disk, no per-example deadline (the CPU is shared),
and a fixed seed, so a run is repeatable and leaves nothing behind."""

from hypothesis import settings

settings.register_profile("badinput", database=None, deadline=None, derandomize=True)
settings.load_profile("badinput")
