"""``--speculative-tree-auto``'s start-up costs: the target's verify forward SGLang would run for a decode batch,
timed per batch size before the first decode step (sglang imported here only).

SGLang's own dummy forward (the one its warm-up and kernel autotune run: ``_dummy_run`` on the target's eager
runner, TARGET_VERIFY mode with the speculative custom mask) is timed for each batch size 1, 2, 4, ... up to
``--max-running-requests`` at two shapes: the tree's tokens per request (a tree step's verify) and one token per
request (what a plain step verifies). A dummy batch has a tiny context and no draft work; ``batch_switch`` scales
these timings by what served steps then take, so the table gives the shape of the cost over batch sizes and the
live steps its level.
"""

from __future__ import annotations

import contextlib
import time

import torch

from sglang_spec.sglang_plugin.batch_switch import StepCosts

REPEATS = 2  # timed runs per shape (the fastest is kept: the others met noise)
MAX_MEASURED_BATCH = 256


def measure_step_costs(worker) -> StepCosts:
    """Time the target's verify forward at 1 and ``speculative_num_draft_tokens`` tokens per request for every
    power-of-two batch size up to the server's running-request cap (``MAX_MEASURED_BATCH`` at most)."""
    runner = worker.target_worker.model_runner
    cap = min(int(worker.server_args.max_running_requests or MAX_MEASURED_BATCH), MAX_MEASURED_BATCH)
    sizes = [1 << k for k in range(cap.bit_length()) if 1 << k <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    tokens = int(worker.speculative_num_draft_tokens)
    tree = _time_batches(runner, sizes, tokens)
    plain = _time_batches(runner, sizes, 1)
    return StepCosts(plain=dict(zip(sizes, plain)), tree=dict(zip(sizes, tree)), tokens=tokens)


def _time_batches(runner, sizes: list[int], tokens_per_request: int) -> list[float]:
    eager = runner.eager_runner
    with _tokens_per_request(runner, tokens_per_request):
        buffers = eager._alloc_dummy_decode_buffers(max(sizes), num_tokens_per_req=tokens_per_request)
        eager._dummy_run(batch_size=sizes[0], buffers=buffers)  # untimed: first-call work (allocations, kernels)
        seconds = []
        for size in sizes:
            runs = []
            for _ in range(REPEATS):
                _synchronize(runner.device)
                start = time.perf_counter()
                eager._dummy_run(batch_size=size, buffers=buffers)
                _synchronize(runner.device)
                runs.append(time.perf_counter() - start)
            seconds.append(min(runs))
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
