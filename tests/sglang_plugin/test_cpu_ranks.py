"""The CPU bed's launch with several scheduler ranks: SGLang's CPU engine checks one NUMA node per rank unless
``SGLANG_CPU_OMP_THREADS_BIND`` names each rank's cores, so the bed names one core per rank for a launch with
tensor, data or pipeline parallelism (``launch_ranks``), and leaves a one-rank launch and a binding the caller
gave as they are."""

from __future__ import annotations

from sglang_spec_testbed import THREADS_BIND_ENV, rank_cores, server_environment
from sglang_spec_testbed.server import launch_ranks


def test_launch_ranks_multiplies_the_parallel_sizes():
    assert launch_ranks(["--model-path", "m"]) == 1
    assert launch_ranks(["--tp-size", "2"]) == 2
    assert launch_ranks(["--tp", "2", "--dp-size=3"]) == 6
    assert launch_ranks(["--tensor-parallel-size", "2", "--pp-size", "2"]) == 4
    # the last spelling in the list wins, as in SGLang's parser (aliases of one option)
    assert launch_ranks(["--tensor-parallel-size", "2", "--tp-size", "3"]) == 3
    assert launch_ranks(["--tp-size=3", "--tensor-parallel-size", "2"]) == 2


def test_one_core_per_rank():
    assert rank_cores(2, cores=2) == "0|1"
    assert rank_cores(3, cores=2) == "0|1|0"
    assert rank_cores(1, cores=8) == "0"


def test_server_environment_binds_ranks_only_when_there_are_several():
    assert THREADS_BIND_ENV not in server_environment({}, ranks=1)
    assert server_environment({}, ranks=2)[THREADS_BIND_ENV] == rank_cores(2)
    assert server_environment({THREADS_BIND_ENV: "0-3|4-7"}, ranks=2)[THREADS_BIND_ENV] == "0-3|4-7"
