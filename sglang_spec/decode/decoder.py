"""The reference tree-speculative decoder, and plain decoding as its baseline.

One step for a batch of requests:
  1. draft: each request's policy grows a tree below its root from the MTP head's top-k candidates
     (exact ancestry, ``MTPDrafter``);
  2. verify: one target forward over every tree (4-D tree mask, tree positions) -> logits at every node;
  3. accept: greedy (temperature 0) or SpecExec's lossless sample-and-match (temperature > 0), or, only when
     asked for, TensorRT-LLM's LOSSY relaxed rule;
  4. commit: each request keeps its accepted path's KV; the MTP head runs over the accepted pairs.
EOS and max_new_tokens are honoured inside an accepted run: the output stops exactly where plain decoding would.

Drafting goes through the one drafter interface (``tree/drafter.TreeDrafter``): a policy whose shape uses the
context (lookup, hybrid) gets each request's n-gram index of its prompt and generated tokens as a second candidate
source beside the head, and every step's outcome is observed into the drafter's per-source counts (online
calibration). The ``lookup`` policy never runs the head.
The target runs on the static-cache runner where the model allows (``decode/static_runner.py``), plain decoding
too, so speedups compare like with like. Every request records its steps (tokens, which source drafted each,
emission time) for latency and ``--trace``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence, TYPE_CHECKING

import torch

from sglang_spec.decode.static_runner import target_runner_for
from sglang_spec.decode.switch import SpeculationSwitch
from sglang_spec.errors import SpecError
from sglang_spec.mtp.expansion import DraftState, MTPDrafter
from sglang_spec.mtp.head import MTPHead
from sglang_spec.sampling import SamplingParams, sample_from_probs, target_probs_from_logits
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.tree.proposal import DraftSources, DraftTree
from sglang_spec.tree.drafter import TreeDrafter
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.verify.greedy import verify_greedy
from sglang_spec.verify.relaxed import RelaxedAcceptance, verify_relaxed_top_n_delta
from sglang_spec.verify.result import VerifyResult
from sglang_spec.verify.sample_match import verify_sample_match_on_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0
    relaxed: RelaxedAcceptance | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SpecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.relaxed is not None and not self.sampling.greedy:
            raise SpecError("relaxed acceptance is a greedy rule (TensorRT-LLM's); use temperature 0 with it")


@dataclass(frozen=True)
class StepRecord:
    """What one step emitted: ``tokens`` in order, ``sources[i]`` who drafted tokens[i] (``tree/profile.py``'s
    SOURCE_* flags; 0 = the target itself: the correction / bonus token, or a plain step's token), the tree's
    node count (0 for the first token, which prefill yields) and ``time``, seconds from the request's start
    until the tokens were there."""

    tokens: tuple[int, ...]
    sources: tuple[int, ...]
    tree_nodes: int
    time: float


@dataclass
class RequestOutput:
    """tokens: generated tokens (the prompt excluded); accept_lengths: tokens emitted per speculative step
    (accepted drafts + 1; the first token comes from prefill and is not a step); top2_gaps: plain decoding only,
    the target's top-1 minus top-2 logit at each generated token (to recognise near-ties); steps: what each step
    emitted and when (the first record is prefill's token)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    accept_lengths: list[int] = field(default_factory=list)
    top2_gaps: list[float] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)

    def token_times(self) -> list[float]:
        """Seconds from the request's start until each generated token was emitted."""
        times = [step.time for step in self.steps for _ in step.tokens]
        return times[: len(self.tokens)]


@dataclass
class GenerationStats:
    steps: int = 0
    draft_forwards: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0


@dataclass
class GenerationOutput:
    requests: list[RequestOutput]
    stats: GenerationStats

    @property
    def generated_tokens(self) -> int:
        return sum(len(request.tokens) for request in self.requests)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.stats.total_seconds if self.stats.total_seconds > 0 else 0.0

    @property
    def accept_lengths(self) -> list[int]:
        return [length for request in self.requests for length in request.accept_lengths]

    @property
    def accept_length_mean(self) -> float:
        lengths = self.accept_lengths
        return sum(lengths) / len(lengths) if lengths else 1.0

    def accept_length_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accept_lengths).items()))


def _record(request: RequestOutput, emitted: Sequence[int], sources: Sequence[int], tree_nodes: int,
            start: float) -> None:
    request.steps.append(StepRecord(tuple(int(t) for t in emitted), tuple(sources), tree_nodes,
                                    time.perf_counter() - start))


def _stop(request: RequestOutput, emitted: Sequence[int], config: GenerationConfig) -> bool:
    """Appends ``emitted`` up to the first EOS or the token budget; True when the request is finished."""
    for token in emitted:
        request.tokens.append(int(token))
        if int(token) in config.eos_token_ids:
            request.finish_reason = "eos"
            return True
        if len(request.tokens) >= config.max_new_tokens:
            request.finish_reason = "length"
            return True
    return False


def _first_token(logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator) -> int:
    if config.sampling.greedy:
        return int(logits.argmax())
    probs = _probs(logits[None, None], config.sampling)[0, 0]
    return int(sample_from_probs(probs, torch.rand((), generator=generator)))


def _probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[B, N, V] logits -> sampling distribution with the same params for every request."""
    batch = logits.shape[0]
    return target_probs_from_logits(
        logits,
        torch.full((batch,), sampling.temperature),
        torch.full((batch,), sampling.top_k, dtype=torch.int64),
        torch.full((batch,), sampling.top_p),
    )


def _top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


@torch.no_grad()
def generate_plain(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], config: GenerationConfig
) -> GenerationOutput:
    """Plain decoding, one request at a time (batch 1, no padding): the baseline speculation must reproduce. Runs
    on the same runner as the speculative decoder (``target_runner_for``)."""
    runner = target_runner_for(model)
    generator = torch.Generator().manual_seed(config.seed)
    stats = GenerationStats()
    outputs = []
    start = time.perf_counter()
    for prompt in prompts:
        request = RequestOutput()
        request_start = time.perf_counter()
        prefill = runner.prefill(torch.tensor(list(prompt), dtype=torch.int64))
        logits, position = prefill.last_logits, len(prompt)
        while True:
            request.top2_gaps.append(_top2_gap(logits))
            token = _first_token(logits, config, generator)
            _record(request, [token], [0], 0 if position == len(prompt) else 1, request_start)
            if _stop(request, [token], config):
                break
            logits = runner.decode_one(token, position, prefill.cache).last_logits
            position += 1
            stats.steps += 1
        outputs.append(request)
    stats.total_seconds = time.perf_counter() - start
    return GenerationOutput(outputs, stats)


Verifier = Callable[[TreeBatch, torch.Tensor, GenerationConfig, torch.Generator], VerifyResult]


def lossless_verify(batch: TreeBatch, logits: torch.Tensor, config: GenerationConfig,
                    generator: torch.Generator) -> VerifyResult:
    """Greedy at temperature 0, else SpecExec's sample-and-match (one coin per node). logits: [B, N, V]."""
    if config.sampling.greedy:
        return verify_greedy(batch, logits.argmax(-1))
    coins = torch.rand(batch.batch_size, batch.max_nodes, generator=generator)
    sampling, size = config.sampling, batch.batch_size
    return verify_sample_match_on_path(batch, logits, torch.full((size,), sampling.temperature),
                                       torch.full((size,), sampling.top_k, dtype=torch.int64),
                                       torch.full((size,), sampling.top_p), coins)


@dataclass
class _Active:
    """A request still decoding: its output, root token (the last verified token), the head's drafting state
    (None when the policy does not use the head), the context index (policies that look the context up), when it
    started and, for the relaxed rule, whether it is inside a thinking span. ``switch`` (a per-step cost curve,
    ``--auto`` over lookup / hybrid) sends it
    to lean plain steps while speculation does not pay; ``waiting``: the (target hidden [d], next token) pairs
    of those steps, appended to the head in one forward when it drafts again."""

    output: RequestOutput
    root: int
    draft: DraftState | None
    context: NgramIndex | None
    start: float
    thinking: bool = False
    switch: SpeculationSwitch | None = None
    waiting: list[tuple[torch.Tensor, int]] = field(default_factory=list)


class SpeculativeDecoder:
    """Tree-speculative decoding with a transformers target, an MTP head and/or the context as candidate sources,
    and any ``TreePolicy``. ``verifier`` replaces the lossless acceptance rule (tests use it to show a biased rule
    is caught); ``static_runner`` forces the runner choice (None: the static-cache runner where the model allows).
    ``tree_drafter`` proposes every tree; its counts start from the policy's profile and learn online across the
    decoder's requests."""

    def __init__(
        self,
        target: PreTrainedModel,
        head: MTPHead | None,
        policy: TreePolicy,
        verifier: Verifier = lossless_verify,
        static_runner: bool | None = None,
    ) -> None:
        if policy.uses_head and head is None:
            raise SpecError(f"the {policy.name} policy drafts with an MTP head; give one (or use --policy lookup)")
        self.runner = target_runner_for(target, static_runner)
        self.runner.prepare(policy.budget + 1)  # a batch-1 tree verify of any size this policy builds
        self.head_drafter = MTPDrafter(head) if policy.uses_head and head is not None else None
        self.tree_drafter = TreeDrafter(policy)
        self.policy = policy
        self.verifier = verifier

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig) -> GenerationOutput:
        if not prompts:
            raise SpecError("give at least one prompt")
        if any(len(prompt) == 0 for prompt in prompts):
            raise SpecError("every prompt needs at least one token")
        generator = torch.Generator().manual_seed(config.seed)
        stats = GenerationStats()
        start = time.perf_counter()
        outputs, active = self._prefill(prompts, config, generator)
        stats.prefill_seconds = time.perf_counter() - start
        states = [request.draft for request in active]
        while active:
            active = self._step(active, config, generator, stats)
        stats.draft_forwards = sum(state.forwards for state in states if state is not None)
        stats.total_seconds = time.perf_counter() - start
        return GenerationOutput(outputs, stats)

    def _prefill(
        self, prompts: Sequence[Sequence[int]], config: GenerationConfig, generator: torch.Generator
    ) -> tuple[list[RequestOutput], list[_Active]]:
        """Runs every prompt alone, takes the first token, starts drafting; merges the unfinished into a batch."""
        outputs, active, prefills = [], [], []
        for prompt in prompts:
            request = RequestOutput()
            outputs.append(request)
            request_start = time.perf_counter()
            prompt_tensor = torch.tensor(list(prompt), dtype=torch.int64)
            prefill = self.runner.prefill(prompt_tensor)
            root = _first_token(prefill.last_logits, config, generator)
            _record(request, [root], [0], 0, request_start)
            if _stop(request, [root], config):
                continue
            draft = None
            if self.head_drafter is not None:
                following = torch.cat([prompt_tensor[1:], torch.tensor([root])]).to(prefill.hidden.device)
                draft = self.head_drafter.prefill(prefill.hidden, following)
            context = NgramIndex([*prompt, root], max_ngram=self.policy.max_ngram) if self.policy.uses_context else None
            costs = self.policy.costs
            switch = None if costs is None else SpeculationSwitch(costs.baseline_token)
            thinking = config.relaxed is not None and config.relaxed.thinking_after([*prompt, root])
            active.append(_Active(request, root, draft, context, request_start, thinking, switch))
            prefills.append(prefill)
        if active:
            self.runner.start_batch(prefills)
        return outputs, active

    def _step(
        self, active: list[_Active], config: GenerationConfig, generator: torch.Generator, stats: GenerationStats
    ) -> list[_Active]:
        """One draft / verify / accept / commit round; returns the requests that continue."""
        stats.steps += 1
        tick = step_start = time.perf_counter()
        lean = [request.switch is not None and request.switch.lean for request in active]
        drafts = self._draft(active, lean)
        stats.draft_seconds += time.perf_counter() - tick

        tick = time.perf_counter()
        batch = TreeBatch.from_trees([draft.tree for draft in drafts])
        forward = self.runner.verify(batch)
        result = self._accept(active, batch, forward.logits.cpu(), config, generator)
        kept = [result.accepted_nodes[row, : int(result.accept_length[row])].tolist() for row in range(len(active))]
        self.runner.commit(kept)
        stats.verify_seconds += time.perf_counter() - tick

        tick = time.perf_counter()
        continuing = self._commit(active, drafts, lean, result, kept, forward.hidden, config)
        now = time.perf_counter()
        stats.draft_seconds += now - tick
        for row in continuing:
            switch = active[row].switch
            if switch is not None:
                if lean[row]:
                    switch.observe_plain(now - step_start)
                else:
                    switch.observe_speculative(now - step_start, active[row].output.accept_lengths[-1])
        if continuing and len(continuing) < len(active):
            self.runner.select(continuing)
        return [active[row] for row in continuing]

    def _draft(self, active: list[_Active], lean: list[bool]) -> list[DraftTree]:
        """Each request's tree: the drafter's proposal, or the root alone on a lean plain step."""
        return [DraftTree.root_only(request.root) if is_lean else self._propose(request)
                for request, is_lean in zip(active, lean)]

    def _accept(self, active: list[_Active], batch: TreeBatch, logits: torch.Tensor, config: GenerationConfig,
                generator: torch.Generator) -> VerifyResult:
        """The acceptance rule over the verify logits [B, N, V]: lossless (``verifier``), or the opt-in relaxed
        rule, which also carries each request's thinking state to the next step."""
        if config.relaxed is None:
            return self.verifier(batch, logits, config, generator)
        thinking = torch.tensor([request.thinking for request in active])
        relaxed = verify_relaxed_top_n_delta(batch, logits, config.relaxed, thinking)
        for request, state in zip(active, relaxed.thinking_after.tolist()):
            request.thinking = state
        return relaxed.result

    def _commit(self, active: list[_Active], drafts: list[DraftTree], lean: list[bool], result: VerifyResult,
                kept: list[list[int]], hidden: torch.Tensor, config: GenerationConfig) -> list[int]:
        """Emits each request's accepted tokens (stopping at EOS / max tokens), lets the drafter observe the
        outcome, and advances the head and the context past them. hidden: [B, N, d] the verify's hidden states.
        Returns the rows that continue."""
        continuing = []
        for row, request in enumerate(active):
            emitted = result.tokens(row)
            request.output.accept_lengths.append(len(emitted))
            sources = [drafts[row].sources[node] for node in kept[row][1:]] + [0]
            _record(request.output, emitted, sources, drafts[row].tree.num_nodes, request.start)
            self.tree_drafter.observe(drafts[row], kept[row])
            if _stop(request.output, emitted, config):
                continue
            continuing.append(row)
            if request.draft is not None and self.head_drafter is not None:
                if lean[row]:  # the head catches up when it drafts again (_propose)
                    request.waiting.append((hidden[row, 0], emitted[0]))
                else:
                    path = torch.tensor(kept[row], device=hidden.device)
                    self.head_drafter.commit(request.draft, hidden[row].index_select(0, path),
                                             torch.tensor(emitted, device=hidden.device))
            if request.context is not None:
                request.context.extend(emitted)
            request.root = emitted[-1]
        return continuing

    def _propose(self, request: _Active) -> DraftTree:
        """This step's tree for one request from its sources (after the head catches up on lean steps' pairs)."""
        if request.waiting and request.draft is not None and self.head_drafter is not None:
            hidden = torch.stack([pair[0] for pair in request.waiting])
            tokens = torch.tensor([pair[1] for pair in request.waiting], device=hidden.device)
            self.head_drafter.commit(request.draft, hidden, tokens)  # the lean steps' pairs, one forward
            request.waiting.clear()
        mtp = None if request.draft is None or self.head_drafter is None else self.head_drafter.source(request.draft)
        return self.tree_drafter.propose(request.root, DraftSources(mtp=mtp, context=request.context))


@dataclass(frozen=True)
class Comparison:
    """How a speculative output compares with the plain one. ``excused``: they diverge at a step where the
    plain run's top-2 logit gap is below the near-tie tolerance (batched float math may flip such an argmax)."""

    identical: bool
    excused: bool
    first_divergence: int | None
    gap_at_divergence: float | None


NEAR_TIE = 1e-4


def compare_with_plain(speculative: RequestOutput, plain: RequestOutput, tolerance: float = NEAR_TIE) -> Comparison:
    for index, (ours, theirs) in enumerate(zip(speculative.tokens, plain.tokens)):
        if ours != theirs:
            gap = plain.top2_gaps[index] if index < len(plain.top2_gaps) else math.inf
            return Comparison(False, gap < tolerance, index, gap)
    if len(speculative.tokens) != len(plain.tokens):
        index = min(len(speculative.tokens), len(plain.tokens))
        return Comparison(False, False, index, None)
    return Comparison(True, False, None, None)
