"""Hardware-aware speculation: measure what verification and drafting cost on this machine, then pick the tree
with the best predicted speedup under an acceptance profile, or no speculation when none pays.

Cost model (Sequoia's, with our decoder's own overheads measured in): one step with a tree of n = budget + 1 nodes
and depth d costs ``verify(n) + d * draft_level + step_overhead`` and yields ``F(T)`` tokens in expectation; plain
decoding costs ``verify(1)`` per token. Speedup = verify(1) * F(T) / step cost. On a CPU verify(n) grows almost
linearly with n (compute-bound), so the best trees are small; on a GPU verify(n) is flat up to tens of tokens
(memory-bound), so the best trees are much larger.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from sglang_spec.decode.target import TargetRunner
from sglang_spec.errors import SpecError
from sglang_spec.mtp.drafter import MTPDrafter
from sglang_spec.mtp.head import MTPHead
from sglang_spec.sampling import SamplingParams
from sglang_spec.tree.cost_model import TreeSizeChoice, choose_tree_size
from sglang_spec.tree.profile import AcceptanceProfile
from sglang_spec.tree.token_tree import TokenTree


@dataclass(frozen=True)
class CostCurve:
    """Seconds. verify[n] = one target forward over n tree tokens (root included) after ``prefix`` tokens;
    draft_level = one head forward over a tree level; step_overhead = the decoder's per-step host work."""

    verify: dict[int, float]
    draft_level: float
    step_overhead: float
    prefix: int
    device: str
    # plain decoding's time per token in its own loop (cache growth and sampling included), prefill excluded;
    # None in curves written before it was measured, then verify[1] stands in
    plain_token: float | None = None

    @property
    def baseline_token(self) -> float:
        """What speculation has to beat: seconds per token of plain decoding."""
        return self.plain_token if self.plain_token is not None else self.verify[1]

    def to_json(self) -> dict:
        return {**asdict(self), "verify": {str(k): v for k, v in self.verify.items()}}

    @classmethod
    def from_json(cls, data: dict) -> CostCurve:
        return cls(**{**data, "verify": {int(k): float(v) for k, v in data["verify"].items()}})


def _median_time(function, repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def measure_costs(
    model: torch.nn.Module,
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
    runner = TargetRunner(model)
    device = runner.device
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(vocab, (prefix,), generator=generator)
    prefill = runner.prefill(prompt)
    verify = {}
    for size in sizes:
        tree = TokenTree.from_parents(list(range(-1, size - 1)), tokens=torch.randint(vocab, (size,), generator=generator))

        def forward(tree=tree, size=size):
            runner.start_batch([type(prefill)(prefill.hidden, prefill.last_logits, copy.deepcopy(prefill.cache))])
            runner.verify([tree], size)

        # the cache copy is not part of a step: time it alone and subtract it
        copying = _median_time(lambda: runner.start_batch(
            [type(prefill)(prefill.hidden, prefill.last_logits, copy.deepcopy(prefill.cache))]), repeats)
        verify[size] = max(_median_time(forward, repeats) - copying, 1e-6)
    draft_level = time_draft_level(head, prefill.hidden, prompt.to(device), repeats)
    # host work per step (tree building, masks, verify rule, cache commits): a real decoder run with one-node
    # chains, minus the forwards it did (a verify of 2 tokens, one draft level, one commit forward)
    from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder, generate_plain
    from sglang_spec.tree.policies import TreePolicy

    # plain decoding in its own loop: a 1-token tree forward misses the cache growth and per-token host work that
    # plain decoding pays, and underestimating the baseline makes every tree look worse than it is
    plain_config = GenerationConfig(max_new_tokens=16, eos_token_ids=(), sampling=sampling)
    prefill_time = _median_time(lambda: runner.prefill(prompt), 3)
    plain_run = generate_plain(model, [prompt.tolist()], plain_config)
    plain_token = max(plain_run.stats.total_seconds - prefill_time, 1e-6) / max(plain_run.stats.steps, 1)
    decoder = SpeculativeDecoder(model, head, TreePolicy("chain", budget=1, depth=1))
    decoder.generate([prompt[:32].tolist()], GenerationConfig(max_new_tokens=4, sampling=sampling))  # warm-up
    run = decoder.generate([prompt.tolist()], GenerationConfig(max_new_tokens=16, sampling=sampling))
    per_step = (run.stats.draft_seconds + run.stats.verify_seconds) / max(run.stats.steps, 1)
    overhead = max(per_step - verify.get(2, verify[1]) - 2 * draft_level, 0.0)
    return CostCurve(verify=verify, draft_level=draft_level, step_overhead=overhead, prefix=prefix,
                     device=f"{device.type} {next(model.parameters()).dtype}", plain_token=plain_token)


def time_draft_level(head: MTPHead, hidden: torch.Tensor, prompt: torch.Tensor, repeats: int = 5) -> float:
    """Median seconds of one head level expanding 4 children of the root, after the head prefilled ``prompt``
    (its target hidden states ``hidden``: [1, P, d] or [P, d]). Dominated by the output head over the draft
    vocabulary, so this is what a reduced draft vocabulary saves."""
    from sglang_spec.tree.candidates import GrowingTree

    drafter = MTPDrafter(head)
    state = drafter.prefill(hidden, torch.cat([prompt[1:], prompt[:1]]))

    def one_level():
        tree = GrowingTree(int(prompt[0]))
        children = [tree.add(0, token, rank, 0.1) for rank, token in enumerate(range(4))]
        drafter.expand(state, tree, children)
        state.cache.crop(-len(children))
        state.nodes.clear()

    return _median_time(one_level, repeats)


def choose_speculation(profile: AcceptanceProfile, costs: CostCurve, max_depth: int = 8,
                       min_speedup: float = 1.3) -> TreeSizeChoice:
    """The Sequoia tree with the best predicted speedup, or budget 0 (plain decoding) when the best predicted
    speedup is below ``min_speedup``: a margin for what the model leaves out. The model times the verify forward
    alone, not the per-node host work of a real step (logits copy, verify rule, sampling), and on the 2-core CI
    CPU it over-predicted by up to 1.3x (docs/training.md), so smaller predicted gains are not trusted."""
    verify = dict(costs.verify)
    if 1 not in verify:
        raise SpecError("the cost curve needs the one-token (plain decoding) time")
    # a step's fixed costs ride on every tree: host work and the commit forward that drafts the root's children
    adjusted = {size: time + costs.step_overhead + costs.draft_level for size, time in verify.items() if size > 1}
    adjusted[1] = costs.baseline_token  # the key-1 entry is the no-speculation baseline
    choice = choose_tree_size(profile, adjusted, draft_time=costs.draft_level, max_depth=max_depth)
    if choice.budget > 0 and choice.speedup < min_speedup:
        return TreeSizeChoice(0, 0, 1.0, costs.baseline_token, 1.0)
    return choice


def load_or_measure(path: Path | None, model: torch.nn.Module, head: MTPHead,
                    sampling: SamplingParams | None = None) -> CostCurve:
    """A cached cost curve for this machine, or a fresh measurement (a few seconds) saved to ``path``."""
    if path is not None and path.exists():
        return CostCurve.from_json(json.loads(path.read_text()))
    costs = measure_costs(model, head, sampling=sampling)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(costs.to_json(), indent=1) + "\n")
    return costs
