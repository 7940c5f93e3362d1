"""``--speculative-tree-auto``'s start-up costs: the target's verify forward SGLang would run for a decode batch,
timed per batch size and verify size before the first step (sglang imported here only).

SGLang's own dummy forward (the one its warm-up and kernel autotune run: ``_dummy_run`` on the target's eager
runner, TARGET_VERIFY mode with the speculative custom mask) is timed for each batch size 1, 2, 4, ... up to
``--max-running-requests`` at the verify sizes the planner may choose (tokens a request, root included). A dummy
batch has a tiny context and no draft work; the planner scales these timings by what served steps then take
(``step_planner``), so the table gives the shape of the cost over batch and verify sizes and the served steps its
level.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Sequence

import torch

from sglang_spec.costs import CostCurve, CostTable

REPEATS = 3  # rounds over every shape (each shape's fastest run is kept: the others met noise)
MAX_MEASURED_BATCH = 256


def measure_step_costs(worker, sizes: Sequence[int]) -> CostTable:
    """The target's verify forward for every power-of-two batch size up to the server's running-request cap
    (``MAX_MEASURED_BATCH`` at most), at the powers of two among ``sizes`` (tokens a request) and their largest:
    the planner reads the sizes between linearly."""
    runner = worker.target_worker.model_runner
    cap = min(int(worker.server_args.max_running_requests or MAX_MEASURED_BATCH), MAX_MEASURED_BATCH)
    batches = [1 << k for k in range(cap.bit_length()) if 1 << k <= cap]
    if batches[-1] != cap:
        batches.append(cap)
    measured = sorted({size for size in sizes if size & (size - 1) == 0} | {max(sizes)})
    seconds = {size: [float("inf")] * len(batches) for size in measured}
    for _ in range(REPEATS):  # rounds over every shape: a slow spell of a shared machine lands on all of them
        for size in measured:
            seconds[size] = [min(old, new) for old, new in zip(seconds[size], _time_batches(runner, batches, size))]
    # a forward of more tokens or more requests never takes less: the envelope keeps noise from inverting them
    for size, previous in zip(measured[1:], measured):
        seconds[size] = [max(time, below) for time, below in zip(seconds[size], seconds[previous])]
    for size in measured:
        seconds[size] = list(itertools.accumulate(seconds[size], max))
    curves = {batch: CostCurve(verify={size: seconds[size][row] for size in seconds}, draft_level=0.0,
                               step_overhead=0.0, prefix=0, device=str(runner.device))
              for row, batch in enumerate(batches)}
    return CostTable(curves)


def _time_batches(runner, sizes: list[int], tokens_per_request: int) -> list[float]:
    eager = runner.eager_runner
    with _tokens_per_request(runner, tokens_per_request):
        buffers = eager._alloc_dummy_decode_buffers(max(sizes), num_tokens_per_req=tokens_per_request)
        eager._dummy_run(batch_size=sizes[0], buffers=buffers)  # untimed: first-call work (allocations, kernels)
        seconds = []
        for size in sizes:
            _synchronize(runner.device)
            start = time.perf_counter()
            eager._dummy_run(batch_size=size, buffers=buffers)
            _synchronize(runner.device)
            seconds.append(time.perf_counter() - start)
    return seconds


@contextlib.contextmanager
def _tokens_per_request(runner, tokens: int):
    """SGLang's dummy verify forward takes its tokens per request from the speculative settings (as SGLang's
    adaptive speculation does when it captures another step count): one shape at a time here, restored after."""
    from sglang.srt.runtime_context import get_spec

    with get_spec().override(speculative_num_draft_tokens=tokens):
        assert runner.decode_num_tokens_per_req() == tokens
        yield


def _synchronize(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
