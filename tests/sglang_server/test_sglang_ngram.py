"""SGLang's own NGRAM speculative algorithm through ``python -m sglang.launch_server --speculative-algorithm NGRAM``
on this CPU, SmolLM2-135M-Instruct as the target: the peer the tree policies are compared with. SGLang's C++
n-gram corpus (compiled through tvm-ffi on first use) drafts, the harness's stand-in for sgl-kernel's
``reconstruct_indices_from_tree_mask`` links the drafted tree, SGLang's verify accepts.

One NGRAM server with SGLang's defaults (12 draft tokens, BFS breadth up to 10, trie depth 18): greedy output
must equal the plain server's (shared fixture) on the held-out prompts and on prompts that repeat their own
context, and drafts must be accepted (accept length above 1), so a server that silently stopped drafting fails.
"""

from __future__ import annotations

import pytest

from cpu_server_helpers import (
    REPEAT_CONTEXT_PROMPTS,
    REPEAT_NEW_TOKENS,
    SMOLLM2_NEW_TOKENS,
    accept_lengths,
    running_server,
)

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

NGRAM_ARGS = ["--speculative-algorithm", "NGRAM"]


@pytest.fixture(scope="module")
def ngram_run(smollm2_cpu, server_logs, smollm2_prompts):
    """The held-out prompts and the repeat-context prompts, decoded greedily through one NGRAM server."""
    with running_server(smollm2_cpu, server_logs, "smollm2-ngram", NGRAM_ARGS) as server:
        info = server.request("/get_server_info")
        heldout = server.generate(smollm2_prompts, {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS})
        repeat = server.generate(list(REPEAT_CONTEXT_PROMPTS),
                                 {"temperature": 0, "max_new_tokens": REPEAT_NEW_TOKENS})
        sampled = server.generate(list(REPEAT_CONTEXT_PROMPTS[:1]),
                                  {"temperature": 0.7, "sampling_seed": 1, "max_new_tokens": REPEAT_NEW_TOKENS})
    return {"info": info, "heldout": heldout, "repeat_context": repeat, "sampled": sampled}


def accept_length(answers: list[dict]) -> float:
    """Generated tokens per verify step over the answers (SGLang's ``spec_accept_length``, pooled)."""
    tokens = sum(answer["meta_info"]["completion_tokens"] for answer in answers)
    steps = sum(answer["meta_info"]["spec_verify_ct"] for answer in answers)
    return tokens / steps


def test_server_runs_sglangs_ngram(ngram_run):
    assert ngram_run["info"]["speculative_algorithm"] == "NGRAM"
    assert ngram_run["info"]["speculative_draft_model_path"] is None


@pytest.mark.parametrize("prompts", ["heldout", "repeat_context"])
def test_ngram_greedy_output_equals_plain_decoding(ngram_run, smollm2_plain_runs, prompts):
    answers, expected = ngram_run[prompts], smollm2_plain_runs[prompts]
    assert len(answers) == len(expected)
    for index, (answer, plain) in enumerate(zip(answers, expected)):
        assert answer["output_ids"] == plain, f"{prompts} prompt {index} differs from plain decoding"


def test_ngram_drafts_are_accepted(ngram_run):
    """Every decode step is an NGRAM verify (SGLang's per-request counts agree with its histogram), and on prompts
    that repeat their context the corpus's drafts are accepted: more than one token per verify step."""
    for prompts in ("heldout", "repeat_context"):
        for answer in ngram_run[prompts]:
            meta = answer["meta_info"]
            assert meta["spec_verify_ct"] == sum(meta["spec_correct_drafts_histogram"])
            assert meta["spec_verify_ct"] <= meta["completion_tokens"]
    repeat, heldout = accept_length(ngram_run["repeat_context"]), accept_length(ngram_run["heldout"])
    longest = max(accept_lengths(ngram_run["repeat_context"]))
    print(f"\nSGLang NGRAM accept length: repeat-context prompts {repeat:.3f} (longest step {longest}), "
          f"held-out prompts {heldout:.3f}")
    assert repeat > 1.2 and longest >= 3, f"NGRAM accepted too little: {repeat:.3f}, longest step {longest}"


def test_sampled_request_goes_through_ngram_verify(ngram_run):
    """A temperature-0.7 request is verified by SGLang's sampling path (the harness's sampling stand-ins): it
    completes, every step an NGRAM verify."""
    meta = ngram_run["sampled"][0]["meta_info"]
    assert meta["completion_tokens"] == REPEAT_NEW_TOKENS
    assert 0 < meta["spec_verify_ct"] == sum(meta["spec_correct_drafts_histogram"])
