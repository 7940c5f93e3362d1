"""target_probs_from_logits takes shortcuts (no sort without top-p, topk without top-p): each gives exactly the
distribution of the full sort-based definition."""

import pytest
import torch

from sglang_spec.sampling import TEMPERATURE_FLOOR, target_probs_from_logits


def sorted_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """The definitions of the docstring, one row at a time, always through a full sort."""
    batch, vocab = logits.shape[0], logits.shape[-1]
    flat = logits.reshape(batch, -1, vocab).float()
    out = torch.empty_like(flat)
    for row in range(batch):
        for node in range(flat.shape[1]):
            values = flat[row, node]
            t = float(temperature[row])
            if not t >= TEMPERATURE_FLOOR:
                out[row, node] = torch.nn.functional.one_hot(values.argmax(), vocab).float()
                continue
            weights = torch.exp((values - values.max()) * (1.0 / torch.tensor(t)))
            ordered = torch.sort(weights, descending=True).values
            k = int(top_k[row])
            kth = ordered[k - 1] if 0 < k < vocab else torch.tensor(0.0)
            kept = torch.where(ordered >= kth, ordered, torch.zeros_like(ordered))
            cumulative = torch.cumsum(kept, 0)
            p = float(top_p[row])
            first = int((cumulative < p * cumulative[-1]).sum().clamp(max=vocab - 1))
            threshold = torch.maximum(kth, ordered[first] if p < 1 else torch.tensor(0.0))
            filtered = torch.where(weights >= threshold, weights, torch.zeros_like(weights))
            out[row, node] = filtered / filtered.sum()
    return out.reshape(logits.shape)


CASES = {
    "all off": ([0.7, 1.0, 0.0], [0, 0, 0], [1.0, 1.0, 1.0]),
    "top-k only, mixed rows": ([0.7, 1.3, 0.5], [5, 0, 200], [1.0, 1.0, 1.0]),
    "top-k one row": ([0.9, 0.9, 0.9], [0, 1, 0], [1.0, 1.0, 1.0]),
    "top-p only": ([0.7, 1.0, 2.0], [0, 0, 0], [0.9, 1.0, 0.5]),
    "both": ([0.7, 1.0, 0.3], [7, 3, 0], [0.8, 1.0, 0.95]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_path_equals_the_sorted_definition(case: str) -> None:
    temperatures, top_ks, top_ps = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    logits = torch.randn(3, 4, 200, generator=generator) * 3
    logits[:, :, 10] = logits[:, :, 11]  # ties at the thresholds are kept
    args = (torch.tensor(temperatures), torch.tensor(top_ks), torch.tensor(top_ps))
    probs = target_probs_from_logits(logits, *args)
    expected = sorted_reference(logits, *args)
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4))
    for row, k in enumerate(top_ks):
        if 0 < k < 200 and temperatures[row] > 0 and top_ps[row] == 1:
            assert int((probs[row] > 0).sum(-1).min()) >= k  # the k largest (and their ties) are kept
            assert int((probs[row] > 0).sum(-1).max()) < 200
