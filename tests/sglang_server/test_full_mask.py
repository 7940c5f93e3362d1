"""The GPU's tree-mask layout through launch_server on this CPU: ``SGLANG_SPEC_CPU_TREE_MASK=full``.

On a CPU SGLang builds QLEN_ONLY tree masks (``n x n`` per request) and on a GPU FULL_MASK ones (``n x (prefix + n)``
per request: the prefix's columns too), so without the switch the bed's server tests never reach the GPU's layout.
With it, SGLang's ``default_tree_mask_mode()`` answers FULL_MASK (``sglang_spec_testbed/tree_mask.py``): its workers
build FULL_MASK trees on their own path and the extend-attention stand-in reads them. Every policy of ours (chain,
eagle, sequoia, specexec, hybrid, lookup, sequoia with the fused accept) runs FULL_MASK in the parity suite
(test_parity_under_load.py: 32 concurrent mixed requests against plain decoding, and the same mask checks as
here); this module runs SGLang's NGRAM with the switch, two prompts in one batch (different prefixes: the layout's
per-request offsets differ): greedy output must equal plain decoding, drafts must be accepted, and the log must
show FULL_MASK masks read by the verify's attention and no QLEN_ONLY mask (NGRAM builds its mask itself: no
build-tree call is logged).
"""

from __future__ import annotations

import re

import pytest

from cpu_server_helpers import REPEAT_CONTEXT_PROMPTS, accept_lengths, assert_full_masks_only, running_server
from sglang_spec_testbed.tree_mask import TREE_MASK_ENV

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

NEW_TOKENS = 24  # a prefix of the plain server's answers (greedy: the same tokens)
PROMPTS = 2  # prompts that repeat their context (NGRAM's corpus drafts from it), sent in one batch
NGRAM_ARGS = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]


@pytest.fixture(scope="module")
def ngram_full_mask_run(smollm2_cpu, server_logs) -> dict:
    """SGLang's NGRAM server with the switch on: its greedy answers and its log."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TREE_MASK_ENV, "full")
        with running_server(smollm2_cpu, server_logs, "smollm2-full-mask-ngram", NGRAM_ARGS) as server:
            answers = server.generate(list(REPEAT_CONTEXT_PROMPTS[:PROMPTS]),
                                      {"temperature": 0, "max_new_tokens": NEW_TOKENS})
    return {"answers": answers, "log": server.log_path.read_text(errors="replace")}


def test_greedy_output_equals_plain_decoding_under_full_mask(ngram_full_mask_run, smollm2_plain_runs):
    plain = smollm2_plain_runs["repeat_context"][:PROMPTS]
    for index, (answer, expected) in enumerate(zip(ngram_full_mask_run["answers"], plain)):
        assert answer["output_ids"] == expected[:NEW_TOKENS], f"ngram: prompt {index} differs from plain decoding"
    lengths = accept_lengths(ngram_full_mask_run["answers"])
    assert lengths and max(lengths) >= 2, f"ngram: no draft was ever accepted ({lengths})"


def test_the_server_read_full_masks_only(ngram_full_mask_run):
    assert_full_masks_only("ngram", ngram_full_mask_run["log"], built=False, read=True)
