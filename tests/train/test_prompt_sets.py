"""The built-in ``pydoc`` prompt set: document-extraction requests over the Python reference the interpreter ships
(the traffic of the extraction head measured in docs/training.md, "A head for document extraction")."""

from __future__ import annotations

import pytest

from sglang_spec.errors import SpecError
from sglang_spec.train.prompts import PYDOC_HEADING_RULE, PYDOC_QUESTIONS, load_prompts, pydoc_passages, pydoc_prompts


def test_pydoc_passages_are_the_reference_text_cut_in_a_fixed_order():
    from pydoc_data.topics import topics

    passages = pydoc_passages()
    assert passages == pydoc_passages()  # the fixed shuffle: a range names the same prompts on every run
    assert len(passages) > 120  # docs/training.md's head trained on 0-119; the rest stays unseen
    assert len(set(passages)) == len(passages)
    bodies = {name: PYDOC_HEADING_RULE.sub("\n", body) for name, body in topics.items()}
    sources = []
    for passage in passages[:10]:
        assert 200 <= len(passage.split()) and len(passage.split(" ")) <= 350
        # cut from the reference, not written here
        sources.append(next(name for name, body in bodies.items() if passage in body))
    assert len(set(sources)) > 1  # shuffled: a short range mixes topics


def test_pydoc_prompts_ask_each_question_in_turn_as_extraction_requests():
    prompts = load_prompts("pydoc:3-12")
    assert [prompt.id for prompt in prompts] == [f"pydoc/{index}" for index in range(3, 13)]
    passages = pydoc_passages()
    for index, prompt in zip(range(3, 13), prompts):
        assert prompt.domain == "extraction" and prompt.reference is None
        (message,) = prompt.messages
        assert message["role"] == "user"
        assert message["content"] == f"{passages[index]}\n\n{PYDOC_QUESTIONS[index % len(PYDOC_QUESTIONS)]}"
    assert load_prompts("pydoc") == pydoc_prompts()
    assert len(load_prompts("pydoc")) == len(passages)


def test_recurring_pydoc_passages_come_back_in_turn_each_with_a_new_question():
    prompts = load_prompts("pydoc:3-5x3")
    assert [prompt.id for prompt in prompts] == [f"pydoc/{index}/{visit}" for visit in range(3)
                                                 for index in range(3, 6)]
    passages = pydoc_passages()
    for prompt in prompts:
        index, visit = map(int, prompt.id.split("/")[1:])
        question = PYDOC_QUESTIONS[(index + visit) % len(PYDOC_QUESTIONS)]
        assert prompt.messages[0]["content"] == f"{passages[index]}\n\n{question}"
    assert len({prompt.messages[0]["content"] for prompt in prompts}) == len(prompts)  # no request repeats
    assert [prompt.messages for prompt in load_prompts("pydoc:3-5x1")] == \
        [prompt.messages for prompt in load_prompts("pydoc:3-5")]


@pytest.mark.parametrize("spec, message", [
    ("pydoc:5-4", "pydoc passage range 5-4 is outside 0-"),
    ("pydoc:0-100000", "pydoc passage range 0-100000 is outside 0-"),
    ("pydoc:x", "unknown prompt set 'pydoc:x': use humaneval:A-B, chatterbot, pydoc:A-B"),
    ("pydoc:0-3x9", "pydoc visits must be 1-8 (one new question each), got 9"),
    ("pydoc:0-3x0", "pydoc visits must be 1-8"),
])
def test_a_bad_pydoc_range_is_one_line(spec, message):
    with pytest.raises(SpecError) as error:
        load_prompts(spec)
    assert message in str(error.value) and "\n" not in str(error.value)
