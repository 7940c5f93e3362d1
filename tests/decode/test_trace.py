"""The trace view: one coloured span per kept token, its source and step in the hover text, tokens past
max_new_tokens cut, per-source counts."""

from sglang_spec.decode.decoder import StepRecord
from sglang_spec.decode.trace import TracedRequest, render_html, render_terminal, source_counts
from sglang_spec.tree.profile import SOURCE_BOTH, SOURCE_LOOKUP, SOURCE_MTP


def decode(tokens):
    return "".join(chr(ord("a") + t) for t in tokens)


STEPS = [
    StepRecord((0,), (0,), 0, 0.01),  # prefill's token
    StepRecord((1, 2, 3), (SOURCE_LOOKUP, SOURCE_LOOKUP, 0), 9, 0.05),
    StepRecord((4, 5), (SOURCE_MTP, 0), 9, 0.09),
    StepRecord((6, 7, 8), (SOURCE_BOTH, SOURCE_LOOKUP, 0), 9, 0.12),  # runs past max_new_tokens = 8
]


def test_counts_and_cut():
    request = TracedRequest("the prompt <b>", STEPS, num_tokens=8)
    assert source_counts(request) == {"target": 3, "lookup": 3, "mtp": 1, "both": 1}


def test_html():
    page = render_html([TracedRequest("the prompt <b>", STEPS, num_tokens=8)], decode, title="t")
    assert page.count("class='t'") == 8 and "the prompt &lt;b&gt;" in page
    assert "title='step 1, lookup, tree 9 nodes, t=50.0 ms'>b</span>" in page
    assert "title='step 3, both, tree 9 nodes" in page and ">i</span>" not in page  # token 8 was cut
    assert "mean accept length 2.67 tokens/step" in page
    assert "<td>2</td><td>9</td><td>1</td><td>mtp 1</td><td>&#x27;f&#x27;</td><td>40.0</td>" in page


def test_terminal():
    text = render_terminal([TracedRequest("p", STEPS, num_tokens=8)], decode)
    assert "--- request 0: both 1, lookup 3, mtp 1, target 3" in text
    assert text.count("\x1b[48;5;114m") == 4  # three lookup tokens + the legend
