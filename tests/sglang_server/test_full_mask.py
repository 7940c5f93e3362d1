"""The GPU's tree-mask layout through launch_server on this CPU: ``SGLANG_SPEC_CPU_TREE_MASK=full``.

On a CPU SGLang builds QLEN_ONLY tree masks (``n x n`` per request) and on a GPU FULL_MASK ones (``n x (prefix + n)``
per request: the prefix's columns too), so the bed's other server tests never reach the GPU's layout. With the
switch, SGLang's ``default_tree_mask_mode()`` answers FULL_MASK (``cpu/tree_mask.py``): its workers build FULL_MASK
trees on their own path and the extend-attention stand-in reads them. One SmolLM2 server per policy (chain,
eagle, sequoia with ``--speculative-tree-accept fused``, specexec, hybrid, lookup) and SGLang's NGRAM, two
prompts in one batch each (different prefixes: the layout's per-request offsets differ): greedy output must equal
plain decoding, drafts must be accepted, and the server's log must show FULL_MASK masks built (by SGLang's
build-tree path) and read (by the verify's attention), and no QLEN_ONLY mask, so a switch that did nothing
fails. A chain (topk 1) is built in FULL_MASK but not read: SGLang's ``intel_amx`` backend passes no mask for
``tree_topk == 1`` (causal attention covers a chain). NGRAM builds its mask itself (no build-tree call): only the
read is logged.
"""

from __future__ import annotations

import re

import pytest

from cpu_server_helpers import REPEAT_CONTEXT_PROMPTS, accept_lengths, running_server, tree_args
from sglang_spec.sglang_plugin.cpu.tree_mask import TREE_MASK_ENV

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

NEW_TOKENS = 24  # a prefix of the plain server's answers (greedy: the same tokens)
PROMPTS = 2  # held-out prompts, sent in one batch
SERVERS = ("chain", "eagle", "sequoia-fused", "specexec", "hybrid", "lookup", "ngram")


def launch_args(name: str, profile) -> list[str]:
    """The server's options after the model's own (``profile``: the acceptance profile shipped with the head)."""
    if name in ("hybrid", "lookup"):
        return ["--speculative-tree-policy", name, "--speculative-tree-budget", "12", "--speculative-tree-depth", "5",
                "--speculative-acceptance-profile", str(profile)]
    if name == "ngram":
        return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    if name == "sequoia-fused":
        return tree_args("sequoia", 12, 4, 4, profile) + ["--speculative-tree-accept", "fused", "--enable-metrics"]
    return tree_args(name, *{"chain": (4, 4, 1), "eagle": (10, 4, 4), "specexec": (12, 4, 4)}[name])


@pytest.fixture(scope="module", params=SERVERS)
def full_mask_run(request, smollm2_cpu, server_logs, smollm2_prompts):
    """One server with the switch on; its greedy answers, its log and (fused) its /metrics."""
    name = request.param
    prompts = list(REPEAT_CONTEXT_PROMPTS[:PROMPTS]) if name == "ngram" else smollm2_prompts[:PROMPTS]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TREE_MASK_ENV, "full")
        with running_server(smollm2_cpu, server_logs, f"smollm2-full-mask-{name}",
                            launch_args(name, smollm2_cpu.profile)) as server:
            answers = server.generate(prompts, {"temperature": 0, "max_new_tokens": NEW_TOKENS})
            metrics = server.request("/metrics") if "fused" in name else None
    return {"name": name, "answers": answers, "log": server.log_path.read_text(errors="replace"), "metrics": metrics}


def test_greedy_output_equals_plain_decoding_under_full_mask(full_mask_run, smollm2_plain_runs):
    name = full_mask_run["name"]
    plain = smollm2_plain_runs["repeat_context" if name == "ngram" else "heldout"][:PROMPTS]
    for index, (answer, expected) in enumerate(zip(full_mask_run["answers"], plain)):
        assert answer["output_ids"] == expected[:NEW_TOKENS], f"{name}: prompt {index} differs from plain decoding"
    lengths = accept_lengths(full_mask_run["answers"])
    assert lengths and max(lengths) >= 2, f"{name}: no draft was ever accepted ({lengths})"
    if full_mask_run["metrics"] is not None:  # the fused accept took the FULL_MASK verify batches
        fused = re.search(r'^sglang_spec_fused_accept_batches_total\{outcome="fused"\} ([0-9.]+)$',
                          full_mask_run["metrics"], re.M)
        assert fused is not None and float(fused.group(1)) > 0, f"{name}: no batch took the fused accept"


def test_the_server_built_and_read_full_masks_only(full_mask_run):
    name, log = full_mask_run["name"], full_mask_run["log"]
    built = re.search(r"\[sglang_spec\] CPU bed: first FULL_MASK tree mask built \((\d+) requests x (\d+) tokens\)",
                      log)
    read = re.search(r"\[sglang_spec\] CPU bed: first FULL_MASK tree mask read \(extend attention: (\d+) requests x "
                     r"(\d+) tokens, (\d+) cells\)", log)
    qlen = re.findall(r"first QLEN_ONLY tree mask .*", log)
    assert not qlen, f"{name}: a QLEN_ONLY mask was built or read: {qlen}"
    assert (built is not None) == (name != "ngram"), f"{name}: {built}"
    assert (read is not None) == (name != "chain"), f"{name}: {read}"
    if read is not None:
        requests, tokens, cells = map(int, read.groups())
        assert cells > requests * tokens * tokens  # the prefix's columns are in the mask
