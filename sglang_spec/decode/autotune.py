"""Hardware-aware speculation: measure what verification, drafting and the decoder's host work cost on this
machine (a ``CostCurve``), for ``costs.py`` to pick the tree with the best predicted speedup under an
acceptance profile, or no speculation when none pays.

On a CPU verify(n) grows almost linearly with n (compute-bound), so the best trees are small; on a GPU verify(n) is
flat up to tens of tokens (memory-bound), so the best trees are much larger.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence, TYPE_CHECKING

import torch

from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder, generate_plain
from sglang_spec.decode.static_runner import target_runner_for
from sglang_spec.decode.target import PrefillOutput, TargetRunner
from sglang_spec.errors import SpecError
from sglang_spec.files import read_json, write_json_atomic
from sglang_spec.mtp.expansion import MTPDrafter
from sglang_spec.mtp.head import MTPHead
from sglang_spec.sampling import SamplingParams
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.tree.candidates import GrowingTree
from sglang_spec.costs import CostCurve, step_seconds
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.token_tree import TokenTree

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _median_time(function: Callable[[], object], repeats: int) -> float:
    """Median seconds of one function after one warm-up call."""
    return interleaved_medians({"only": function}, repeats)["only"]


@torch.no_grad()
def measure_costs(
    model: PreTrainedModel,
    head: MTPHead,
    sizes: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64),
    prefix: int = 200,
    repeats: int = 5,
    sampling: SamplingParams | None = None,
) -> CostCurve:
    """Times target forwards over chain-shaped trees of each size after a ``prefix``-token cache, and one head
    level, on the model's own device and dtype. Plain decoding and the per-step host work are timed with
    ``sampling`` (default greedy): sampled verification costs more per step than greedy."""
    sampling = sampling or SamplingParams()
    runner = target_runner_for(model)  # the runner the decoder and plain decoding use
    prompt = torch.randint(model.config.vocab_size, (prefix,), generator=torch.Generator().manual_seed(0))
    prefill = runner.prefill(prompt)
    forwards = CostCurve(
        verify=_verify_times(runner, prefill, sizes, repeats),
        draft_level=time_draft_level(head, prefill.hidden, prompt.to(runner.device), repeats),
        step_overhead=0.0,
        prefix=prefix,
        device=f"{runner.device.type} {runner.dtype}",
        plain_token=_plain_token_seconds(runner, prompt, sampling),
    )
    # host work per step (tree building, masks, verify rule, cache commits): a real decoder step with a one-node
    # chain, minus what step_seconds charges for its forwards (a 2-token verify and one head forward)
    per_step = _decoder_step_seconds(model, head, prompt, sampling)
    overhead = max(per_step - step_seconds(forwards, nodes=2, depth=1), 0.0)
    return replace(forwards, step_overhead=overhead)


def interleaved_medians(
    functions: dict[Any, Callable[[], object]], repeats: int, warmup: int = 1, device: str | torch.device | None = None
) -> dict[Any, float]:
    """Median seconds of each function, timed in rounds that take them in turn (after ``warmup`` rounds): a slow
    spell of a shared machine then lands on all of them instead of inflating one. ``device``: see
    ``interleaved_times``."""
    times = interleaved_times(functions, repeats, warmup, device)
    return {key: sorted(values)[len(values) // 2] for key, values in times.items()}


def interleaved_times(
    functions: dict[Any, Callable[[], object]], repeats: int, warmup: int = 1, device: str | torch.device | None = None
) -> dict[Any, list[float]]:
    """Seconds of every timed call of each function, in rounds that take the functions in turn (after ``warmup``
    rounds). On a CUDA ``device`` a call is timed by CUDA events around it and waited for (the GPU's time for the
    work it queued, not the host's time to queue it); elsewhere by the host clock."""
    cuda = device is not None and torch.device(device).type == "cuda"
    for _ in range(warmup):
        for function in functions.values():
            function()
    times: dict[Any, list[float]] = {key: [] for key in functions}
    for _ in range(repeats):
        for key, function in functions.items():
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                function()
                end.record()
                end.synchronize()
                times[key].append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                function()
                times[key].append(time.perf_counter() - begin)
    return times


def _verify_times(
    runner: TargetRunner, prefill: PrefillOutput, sizes: Sequence[int], repeats: int
) -> dict[int, float]:
    """verify[n]: one target forward over an n-token chain after the prefilled prompt (medians over rounds that
    take the sizes in turn, then made non-decreasing in n)."""
    vocab = runner.config.vocab_size
    generator = torch.Generator().manual_seed(1)

    def fresh_batch() -> None:
        runner.start_batch([replace(prefill, cache=copy.deepcopy(prefill.cache))])

    forwards: dict[Any, Callable[[], object]] = {"copy": fresh_batch}  # not part of a step: timed and subtracted
    for size in sizes:
        tree = TokenTree.from_parents(list(range(-1, size - 1)),
                                      tokens=torch.randint(vocab, (size,), generator=generator))

        def forward(tree: TokenTree = tree) -> None:
            fresh_batch()
            runner.verify(TreeBatch.from_trees([tree]))

        forwards[size] = forward
    timed = interleaved_medians(forwards, repeats)
    copying = timed.pop("copy")
    verify = {size: max(seconds - copying, 1e-6) for size, seconds in timed.items()}
    # a verify of n tokens costs no more than one of more tokens: what is left of noise must not make a small
    # tree (or the plain step) look dearer than a larger one
    ceiling = float("inf")
    for size in sorted(verify, reverse=True):
        ceiling = min(ceiling, verify[size])
        verify[size] = ceiling
    return verify


def _plain_token_seconds(runner: TargetRunner, prompt: torch.Tensor, sampling: SamplingParams) -> float:
    """Plain decoding's seconds per token in its own loop: a 1-token tree forward misses the cache growth and
    per-token host work that plain decoding pays, and underestimating the baseline makes every tree look worse."""
    config = GenerationConfig(max_new_tokens=16, eos_token_ids=(), sampling=sampling)
    prefill_time = _median_time(lambda: runner.prefill(prompt), 3)
    run = generate_plain(runner.model, [prompt.tolist()], config)
    return max(run.stats.total_seconds - prefill_time, 1e-6) / max(run.stats.steps, 1)


def _decoder_step_seconds(
    model: PreTrainedModel, head: MTPHead, prompt: torch.Tensor, sampling: SamplingParams
) -> float:
    """Seconds per step of the real decoder with a one-node chain (budget 1, depth 1), after a warm-up."""
    decoder = SpeculativeDecoder(model, head, TreePolicy("chain", budget=1, depth=1))
    decoder.generate([prompt[:32].tolist()], GenerationConfig(max_new_tokens=4, sampling=sampling))  # warm-up
    run = decoder.generate([prompt.tolist()], GenerationConfig(max_new_tokens=16, sampling=sampling))
    return (run.stats.draft_seconds + run.stats.verify_seconds) / max(run.stats.steps, 1)


def time_draft_level(head: MTPHead, hidden: torch.Tensor, prompt: torch.Tensor, repeats: int = 5) -> float:
    """Median seconds of one head level expanding 4 children of the root, after the head prefilled ``prompt`` [P]
    with its target hidden states ``hidden`` [P, d]. Dominated by the output head over the draft vocabulary, so
    this is what a reduced draft vocabulary saves."""
    if hidden.dim() != 2 or hidden.shape[0] != prompt.shape[0]:
        raise SpecError(f"hidden must be [P, d] for a P = {prompt.shape[0]}-token prompt, got {tuple(hidden.shape)}")
    drafter = MTPDrafter(head)
    state = drafter.prefill(hidden, torch.cat([prompt[1:], prompt[:1]]))

    def one_level() -> None:
        tree = GrowingTree(int(prompt[0]))
        children = [tree.add(0, token, rank, 0.1) for rank, token in enumerate(range(4))]
        drafter.expand(state, tree, children)
        state.cache.crop(-len(children))
        state.nodes.clear()

    return _median_time(one_level, repeats)


def load_or_measure(
    path: Path | None,
    model: PreTrainedModel,
    head: MTPHead,
    sampling: SamplingParams | None = None,
    on_bad_cache: Callable[[str], None] | None = None,
) -> CostCurve:
    """A cached cost curve for this machine, or a fresh measurement (a few seconds) saved to ``path`` atomically.

    A file at ``path`` that cannot be read as a cost curve is refused (``SpecError``), unless ``on_bad_cache`` is
    given (the default cache, ours to rebuild): then it is told why, and the curve is measured and rewritten."""
    if path is not None and path.exists():
        try:
            data = read_json(path, "cost curve")  # its messages name the path
            return CostCurve.from_json(data)
        except SpecError as error:
            problem = str(error) if str(path) in str(error) else f"cost curve {path}: {error}"
            if on_bad_cache is None:
                raise SpecError(f"{problem}; delete it to measure again") from None
            on_bad_cache(f"ignoring the damaged cost cache ({problem}); measuring again")
    costs = measure_costs(model, head, sampling=sampling)
    if path is not None:
        try:
            write_json_atomic(path, costs.to_json())
        except SpecError as error:
            if on_bad_cache is None:
                raise
            on_bad_cache(f"the measured cost curve was not cached: {error}")
    return costs
