"""The benchmark scripts' library: what a result was measured on, the one timer, a model's heads, profiles and
prompts, decoding one prompt at a time, Hugging Face's baselines, tree fixtures, the head-quality metrics, and the
Markdown tables the reports print.

The scripts in ``bench/`` import this module as a sibling (``python bench/acceptance.py`` puts ``bench/`` on the
path); nothing in ``sglang_spec`` imports ``bench``. At import it needs torch, numpy and the decoder's part of
``sglang_spec`` (no transformers, no Triton kernel), so ``bench/kernels.py`` may import it before it chooses the
Triton interpreter, and ``bench/gpu_check.py`` imports it only after its preflight has found torch. The model
registry, the calibration and the tiny model's builder need safetensors: the functions that use them import
them, so the GPU checks' scripts run on a machine without it.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np
import torch

from sglang_spec.decode.autotune import interleaved_medians
from sglang_spec.decode.decoder import (
    GenerationConfig,
    GenerationOutput,
    GenerationStats,
    SpeculativeDecoder,
    compare_with_plain,
)
from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.mtp.head import MTPHead
from sglang_spec.train.prompts import load_prompts
from sglang_spec.train.records import EncodedRecord
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile
from sglang_spec.tree.token_tree import TokenTree

if TYPE_CHECKING:
    from sglang_spec.models.loading import LoadedModel

REPO = Path(__file__).resolve().parents[1]

# Tree sizes (nodes, root included) a verify is timed at.
# The cost curve: every size up to 6 and then about 1.5x apart, because on a CPU verify time grows with every
# node and the best trees are small, so the small sizes decide the choice; up to the largest budget swept (64).
COST_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
# The limits table: one row per doubling over the same range.
LIMIT_SIZES = (1, 2, 4, 8, 16, 32, 64)
# A quick run (the tiny model, CI): a few points over the small trees it runs, in seconds.
QUICK_COST_SIZES = (1, 2, 4, 8, 16)
QUICK_LIMIT_SIZES = (1, 4, 16)


# ------------------------------------------------------------------------------------------------ environment
def commit() -> str | None:
    """The checkout's short commit, with ``+modified`` when tracked files differ from it, or None in a copy
    without git. A GPU machine's copy of the checkout carries the working tree of the call and the ``.git`` of the
    session's start, so a run there after later commits reads as modified, not as the older commit."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return (head + "+modified" if git("status", "--porcelain", "--untracked-files=no") else head) or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: str | torch.device = "cpu") -> str:
    """A CUDA device's name, or the CPU's with its core count."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU"


def environment(device: str | None = None, **extra: Any) -> dict[str, Any]:
    """What a result was measured on: ``device`` (default: the CUDA device if there is one, else the CPU), torch,
    Python and the commit; a script's own fields (``extra``) after them."""
    if device is None:
        device = device_name("cuda" if torch.cuda.is_available() else "cpu")
    return {"device": device, "torch": torch.__version__, "python": platform.python_version(), "commit": commit(),
            **extra}


def model_environment(loaded: LoadedModel, **extra: Any) -> dict[str, Any]:
    """``environment`` for a run of one model: its device, name and dtype, and torch's threads."""
    parameter = next(loaded.model.parameters())
    return environment(device_name(parameter.device), model=loaded.name,
                       dtype=str(parameter.dtype).replace("torch.", ""), threads=torch.get_num_threads(), **extra)


# ------------------------------------------------------------------------------------------------ timing
def median_seconds(function: Callable[[], object], repeats: int = 9, warmup: int = 1,
                   device: str | torch.device | None = None) -> float:
    """Median seconds of one function after ``warmup`` calls (CUDA events on a CUDA ``device``): the project's one
    timer, ``autotune.interleaved_medians``, over a single function. Functions timed against each other go to it
    (or to ``autotune.interleaved_times`` for every call's time) together, so a slow spell hits them all."""
    return interleaved_medians({"only": function}, repeats, warmup, device)["only"]


# ------------------------------------------------------------------------------------------------ models, prompts
def load_heads(loaded: LoadedModel, spec: str | None) -> dict[str, MTPHead]:
    """name -> head: ``spec`` "name=PATH,...", else the model's shipped heads (SmolLM2: generic and code)."""
    from sglang_spec.models.loading import load_head_for, shipped_head_path  # safetensors

    if spec:
        return {name: load_head_for(loaded, path) for name, path in (item.split("=", 1) for item in spec.split(","))}
    if loaded.name == "smollm2":
        generic = shipped_head_path("smollm2-generic")
        heads = {}
        if generic is not None:
            heads["generic"] = load_head_for(loaded, generic)
        heads["code"] = load_head_for(loaded, None)
        return heads
    return {"default": load_head_for(loaded, None)}


def load_profiles(
    loaded: LoadedModel, heads: dict[str, MTPHead], spec: str | None, temperatures: list[float]
) -> dict[tuple[str, float], AcceptanceProfile]:
    """(head, temperature) -> profile: given ones ("name@temperature=PATH,..."), else shipped ones, else a
    generic one (tiny models)."""
    from sglang_spec.models.loading import shipped_profile_path  # safetensors

    given = {}
    if spec:
        for item in spec.split(","):
            key, path = item.split("=", 1)
            name, temperature = key.split("@")
            given[(name, float(temperature))] = AcceptanceProfile.from_json(path)
    result = {}
    for name in heads:
        for temperature in temperatures:
            if (name, temperature) in given:
                result[(name, temperature)] = given[(name, temperature)]
                continue
            label = loaded.name if name in ("code", "default") else f"{loaded.name}-{name}"
            path = shipped_profile_path(label, temperature)
            if path is not None:
                result[(name, temperature)] = AcceptanceProfile.from_json(path)
            else:
                result[(name, temperature)] = AcceptanceProfile.uniform([0.6, 0.2, 0.1, 0.05])
                print(f"  no profile for head {name} at T={temperature}: using a generic one")
    return result


def load_prompt_tokens(loaded: LoadedModel, spec: str, count: int, seed: int) -> tuple[list[list[int]], list[str]]:
    """(prompt tokens, prompt ids): ``spec`` "toy" (the tiny model's toy language) or a prompt set."""
    from sglang_spec.train.generate_traffic import prompt_tokens  # safetensors

    if spec == "toy":
        language = ToyLanguage(loaded.model.config.vocab_size, seed=123 + seed)
        prompts = [language.sample(1, 8)[0].tolist() for _ in range(count)]
        return prompts, [f"toy/{i}" for i in range(count)]
    specs = load_prompts(spec)[:count]
    return [prompt_tokens(loaded, s) for s in specs], [s.id for s in specs]


def repeating_toy_prompts(loaded: LoadedModel) -> list[list[int]]:
    """Three prompts of the tiny model's toy language that repeat a piece of 5 / 7 / 9 tokens three times and start
    it again: their continuations copy, so context lookup has something to find (the benches' ``--quick`` runs)."""
    language = ToyLanguage(loaded.model.config.vocab_size, seed=321)
    pieces = [language.sample(1, length)[0].tolist() for length in (5, 7, 9)]
    return [piece * 3 + piece[:2] for piece in pieces]


# ------------------------------------------------------------------------------------------------ decoding
def one_by_one(
    decoder: SpeculativeDecoder, prompts: Sequence[list[int]], config: GenerationConfig
) -> GenerationOutput:
    """Batch 1, one request after another with one decoder (what it learns online carries across the prompts),
    exactly as plain decoding runs: tokens/s are comparable."""
    outputs = [decoder.generate([prompt], config) for prompt in prompts]
    totals = {field.name: sum(getattr(o.stats, field.name) for o in outputs) for field in fields(GenerationStats)}
    stats = GenerationStats(**totals)
    return GenerationOutput([output.requests[0] for output in outputs], stats)


def greedy_identity(output: GenerationOutput, plain: GenerationOutput) -> tuple[bool, int]:
    """(every request equals plain decoding's, excused near-ties among them): a divergence is excused only where
    plain decoding's top-2 logit gap was a near-tie."""
    comparisons = [compare_with_plain(ours, theirs) for ours, theirs in zip(output.requests, plain.requests)]
    return all(c.identical or c.excused for c in comparisons), sum(c.excused for c in comparisons)


class TimingStreamer:
    """A ``generate(streamer=...)`` hook recording when each chunk of new tokens arrived."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.start = time.perf_counter()
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter() - self.start
        self.times += [now] * int(value.numel())

    def end(self) -> None:
        pass


@dataclass
class HFRun:
    """Hugging Face ``generate`` over the prompts: tokens per prompt, seconds in all, each token's arrival time."""

    tokens: list[list[int]]
    seconds: float
    times: list[list[float]]

    @property
    def tokens_per_second(self) -> float:
        return sum(len(tokens) for tokens in self.tokens) / self.seconds

    def identical_to(self, plain: GenerationOutput, config: GenerationConfig) -> bool | None:
        """Greedy: every output equals plain decoding's (None when sampling: nothing to compare)."""
        if not config.sampling.greedy:
            return None
        return all(ours == theirs.tokens for ours, theirs in zip(self.tokens, plain.requests))


def hf_generate(loaded: LoadedModel, prompts: Sequence[list[int]], config: GenerationConfig,
                lookup: int | None = None) -> HFRun:
    """Hugging Face's own ``generate``, batch 1, one prompt after another with the same budget and sampling: plain,
    or prompt-lookup decoding (n-gram drafts from the prompt) with ``lookup`` draft tokens. A sampled prompt is
    seeded with ``config.seed`` + its index."""
    outputs, times, seconds = [], [], 0.0
    for index, prompt in enumerate(prompts):
        kwargs: dict[str, Any] = dict(max_new_tokens=config.max_new_tokens, pad_token_id=0,
                                      eos_token_id=list(config.eos_token_ids) or None)
        if lookup is not None:
            kwargs["prompt_lookup_num_tokens"] = lookup
        if config.sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=config.sampling.temperature, top_k=0, top_p=1.0)
            torch.manual_seed(config.seed + index)
        streamer = TimingStreamer()
        start = time.perf_counter()
        streamer.start = start
        with torch.no_grad():
            output = loaded.model.generate(input_ids=torch.tensor([prompt]), streamer=streamer, **kwargs)
        seconds += time.perf_counter() - start
        outputs.append(output[0, len(prompt):].tolist())
        times.append(streamer.times)
    return HFRun(outputs, seconds, times)


# ------------------------------------------------------------------------------------------------ tree fixtures
def random_tree(size: int, vocab: int, seed: int = 0) -> TokenTree:
    """A branching tree of ``size`` nodes (up to 3 children per node), the kind a hybrid step verifies."""
    rng = np.random.default_rng(seed)
    parents = [-1]
    for node in range(1, size):
        parents.append(int(rng.integers(max(0, node - 3), node)))
    return TokenTree.from_parents(parents, tokens=rng.integers(vocab, size=size).tolist())


def balanced_tree(nodes: int, topk: int) -> tuple[list[int], list[int]]:
    """Breadth-first tree with up to ``topk`` children per node: parents and sibling ranks."""
    parents, ranks = [-1], [0]
    for node in range(1, nodes):
        parents.append((node - 1) // topk)
        ranks.append((node - 1) % topk)
    return parents, ranks


def depth_of(parents: list[int]) -> int:
    """The deepest node's depth (at least 1) of a tree given by its parents (a parent before its children)."""
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return max(max(depths), 1)


# ------------------------------------------------------------------------------------------------ head quality
def head_quality(
    loaded: LoadedModel,
    head: MTPHead,
    prompts: Sequence[list[int]],
    plain: GenerationOutput,
    profile: AcceptanceProfile,
    tree_sizes: Sequence[int],
    config: GenerationConfig,
) -> dict[str, float | list[float]]:
    """The baseline metrics of one head on the held-out prompts (temperature 0): depth-1 top-1/4/8 acceptance
    (calibrated on plain decoding's own completions), chain-4 accept length and tree accept lengths."""
    from sglang_spec.train.calibrate import calibrate  # safetensors

    records = [EncodedRecord(f"heldout/{i}/greedy", list(prompt) + list(request.tokens), len(prompt))
               for i, (prompt, request) in enumerate(zip(prompts, plain.requests))]
    calibration = calibrate(loaded, head, records, depth=4, max_rank=8, temperature=0.0, progress=False)
    depth_one = calibration.profile.row(1)
    result: dict[str, float | list[float]] = {
        "depth1_top1": depth_one[0],
        "depth1_top4": sum(depth_one[:4]),
        "depth1_top8": sum(depth_one[:8]),
        "depth_top1": calibration.top1,
    }
    chain = SpeculativeDecoder(loaded.model, head, TreePolicy("chain", 4, 4)).generate(prompts, config)
    result["chain4_accept_length"] = chain.accept_length_mean
    for size in tree_sizes:
        for name in ("sequoia", "specexec"):
            depth = 6 if size > 16 else 4
            policy = TreePolicy(name, budget=size, depth=depth, profile=profile, topk=8)
            output = SpeculativeDecoder(loaded.model, head, policy).generate(prompts, config)
            result[f"{name}{size}_accept_length"] = output.accept_length_mean
    return result


# ------------------------------------------------------------------------------------------------ reports
def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table's lines: the header, its rule, one line per row (cells as given, already formatted)."""
    return ([f"| {' | '.join(header)} |", "|" + "---|" * len(header)]
            + [f"| {' | '.join(str(cell) for cell in row)} |" for row in rows])


def identical_cell(identical: bool | None, near_ties: int = 0) -> str:
    """A result row's greedy identity: "yes", "NO", or empty when sampled; excused near-ties after it."""
    cell = {None: "", True: "yes", False: "NO"}[identical]
    return cell + (f" ({near_ties} near-tie)" if near_ties else "")


def accept_cell(accept_length: float) -> str:
    """A result row's accept length, empty where there is none (NaN: Hugging Face's runs)."""
    return "" if math.isnan(accept_length) else f"{accept_length:.2f}"
