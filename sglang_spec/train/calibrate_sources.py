"""Calibrating hybrid trees: how often each source's candidates are accepted, per cell of ``SourceCalibration``
(lookup by match length and rank, head by depth and draft probability, both by match length).

The measurement is the decoder's own online calibration run from a negligible prior: decoding traffic prompts with
a wide hybrid tree (many candidates of every kind offered at every accepted node) counts, for every offered
candidate, whether it was the accepted child. Those counts are exactly the conditional acceptance
P(accepted | parent accepted) the best-first selection multiplies along a path. Calibrate on prompts the
benchmarks never see (``sglang-spec calibrate-sources``; ``scripts/calibrate_sources.sh`` uses the heads' training
prompts).
"""

from __future__ import annotations

from typing import Sequence

from tqdm import tqdm

from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
from sglang_spec.models.registry import LoadedModel
from sglang_spec.mtp.head import MTPHead
from sglang_spec.tree.hybrid import HybridPolicy, SourceCalibration
from sglang_spec.tree.ngram import DEFAULT_MAX_NGRAM

# a prior this light is outweighed by the first observation of a cell; unobserved cells keep its guess
_NEGLIGIBLE = 1e-3


def calibrate_sources(
    loaded: LoadedModel,
    head: MTPHead,
    prompts: Sequence[list[int]],
    config: GenerationConfig,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    progress: bool = True,
) -> SourceCalibration:
    """Counts of accepted / offered candidates per cell, over greedy or sampled decoding (``config``) of
    ``prompts`` with a wide hybrid tree."""
    policy = HybridPolicy("hybrid", budget=32, depth=10, mtp_levels=3, topk=4, lookup_width=4, max_ngram=max_ngram,
                          calibration=SourceCalibration.generic(max_ngram, weight=_NEGLIGIBLE))
    decoder = SpeculativeDecoder(loaded.model, head, policy)
    for prompt in tqdm(prompts, desc="calibrating sources", disable=not progress):
        decoder.generate([prompt], config)
    assert decoder.calibration is not None
    calibration = decoder.calibration
    calibration.source = f"{len(prompts)} prompts, temperature {config.sampling.temperature}"
    return calibration

