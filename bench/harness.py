"""What the benchmark scripts share: a model's heads and profiles, prompt tokens, decoding one prompt at a time,
and the head-quality metrics of the issue's baseline.

The scripts in ``bench/`` import this module as a sibling (``python bench/acceptance.py`` puts ``bench/`` on the
path); nothing in ``sglang_spec`` imports ``bench``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Sequence

from sglang_spec.decode.decoder import GenerationConfig, GenerationOutput, GenerationStats, SpeculativeDecoder
from sglang_spec.models.registry import LoadedModel, load_head_for, shipped_head_path, shipped_profile_path
from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.mtp.head import MTPHead
from sglang_spec.train.calibrate import calibrate
from sglang_spec.train.generate_traffic import prompt_tokens
from sglang_spec.train.prompts import load_prompts
from sglang_spec.train.traffic import TrafficRecord
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile


def load_heads(loaded: LoadedModel, spec: str | None) -> dict[str, MTPHead]:
    """name -> head: ``spec`` "name=PATH,...", else the model's shipped heads (SmolLM2: generic and code)."""
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
    if spec == "toy":
        language = ToyLanguage(loaded.model.config.vocab_size, seed=123 + seed)
        prompts = [language.sample(1, 8)[0].tolist() for _ in range(count)]
        return prompts, [f"toy/{i}" for i in range(count)]
    specs = load_prompts(spec)[:count]
    return [prompt_tokens(loaded, s) for s in specs], [s.id for s in specs]


def one_by_one(
    decoder: SpeculativeDecoder, prompts: Sequence[list[int]], config: GenerationConfig
) -> GenerationOutput:
    """Batch 1, one request after another, exactly as plain decoding runs: tokens/s are comparable."""
    outputs = [decoder.generate([prompt], config) for prompt in prompts]
    totals = {field.name: sum(getattr(o.stats, field.name) for o in outputs) for field in fields(GenerationStats)}
    stats = GenerationStats(**totals)
    return GenerationOutput([output.requests[0] for output in outputs], stats)


def head_quality(
    loaded: LoadedModel,
    head: MTPHead,
    prompts: Sequence[list[int]],
    plain: GenerationOutput,
    profile: AcceptanceProfile,
    tree_sizes: Sequence[int],
    config: GenerationConfig,
) -> dict[str, float | list[float]]:
    """The issue's baseline metrics for one head on the held-out prompts (temperature 0): depth-1 top-1/4/8
    acceptance (calibrated on plain decoding's own completions), chain-4 accept length and tree accept lengths."""
    records = [
        TrafficRecord(f"heldout/{i}/greedy", "code", loaded.decode(request.tokens), prompt=loaded.decode(prompt))
        for i, (prompt, request) in enumerate(zip(prompts, plain.requests))
    ]
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
