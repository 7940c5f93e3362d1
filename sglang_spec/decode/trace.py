"""Where speculation pays, shown token by token: each step's accepted draft tokens coloured by the source that
drafted them (context lookup, MTP head, both), then the target's own token (the correction, or the bonus after a
fully accepted path), as an HTML page or a terminal view (``sglang-spec generate --trace``).

Input is what the decoder records anyway (``RequestOutput.steps``: tokens, sources, tree size, emission time),
so tracing costs nothing while decoding.
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from sglang_spec.decode.decoder import RequestOutput, StepRecord
from sglang_spec.tree.profile import SOURCE_BOTH, SOURCE_LOOKUP, SOURCE_MTP, SOURCE_NAMES

# background colours per source (HTML) and ANSI 256-colour backgrounds (terminal)
_HTML_COLOURS = {SOURCE_LOOKUP: "#b7e4c7", SOURCE_MTP: "#bdd7ff", SOURCE_BOTH: "#e2c6ff", 0: "#ffd8a8"}
_ANSI_COLOURS = {SOURCE_LOOKUP: 114, SOURCE_MTP: 111, SOURCE_BOTH: 183, 0: 223}
_LEGEND = {
    SOURCE_LOOKUP: "drafted by the context lookup",
    SOURCE_MTP: "drafted by the MTP head",
    SOURCE_BOTH: "drafted by both",
    0: "the target's own token (correction / bonus, or no speculation)",
}


@dataclass(frozen=True)
class TracedRequest:
    """One request to show: its prompt text, its steps and the number of generated tokens kept (a step may run
    past max_new_tokens or an EOS)."""

    prompt: str
    steps: Sequence[StepRecord]
    num_tokens: int

    @classmethod
    def of(cls, prompt: str, output: RequestOutput) -> TracedRequest:
        return cls(prompt, list(output.steps), len(output.tokens))


def _kept(request: TracedRequest) -> list[tuple[int, list[tuple[int, int]], int, float]]:
    """(step index, [(token, source)], tree nodes, time) per step, cut at the generated tokens kept."""
    result, left = [], request.num_tokens
    for index, step in enumerate(request.steps):
        tokens = list(step.tokens)[:left]
        sources = list(step.sources)[: len(tokens)]
        left -= len(tokens)
        if tokens:
            result.append((index, list(zip(tokens, sources)), step.tree_nodes, step.time))
    return result


def source_counts(request: TracedRequest) -> dict[str, int]:
    """Generated tokens per source name."""
    counts = Counter(SOURCE_NAMES[source] for _, pairs, _, _ in _kept(request) for _, source in pairs)
    return dict(counts)


def render_html(requests: Sequence[TracedRequest], decode: Callable[[list[int]], str], title: str = "trace") -> str:
    """A self-contained HTML page: per request the text with one coloured span per token (hover: step, source,
    tree size, time), a thin bar between steps, then a per-step table."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}",
        ".text{font-family:ui-monospace,monospace;white-space:pre-wrap;line-height:1.9;border:1px solid #ccc;"
        "padding:1em}",
        ".t{border-radius:2px}.step{border-left:2px solid #555;margin-left:1px}",
        "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}",
        ".legend span{padding:2px 6px;margin-right:1em}",
        "</style></head><body>",
        f"<h1>{html.escape(title)}</h1><p class='legend'>",
    ]
    parts += [f"<span style='background:{_HTML_COLOURS[s]}'>{html.escape(text)}</span>" for s, text in _LEGEND.items()]
    parts.append("</p>")
    for number, request in enumerate(requests):
        steps = _kept(request)
        counts = source_counts(request)
        total = sum(counts.values())
        drafted = total - counts.get("target", 0)
        speculative = [len(step.tokens) for step in request.steps[1:]]
        mean = sum(speculative) / len(speculative) if speculative else 1.0
        parts.append(f"<h2>request {number}</h2><details><summary>prompt</summary><pre>{html.escape(request.prompt)}"
                     "</pre></details>")
        parts.append(f"<p>{total} tokens in {len(steps)} steps (the first from prefill); {drafted} drafted and "
                     f"accepted ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); mean accept length "
                     f"{mean:.2f} tokens/step</p><div class='text'>")
        for index, pairs, nodes, seconds in steps:
            parts.append("<span class='step'></span>")
            for token, source in pairs:
                label = f"step {index}, {SOURCE_NAMES[source]}, tree {nodes} nodes, t={seconds * 1e3:.1f} ms"
                text = html.escape(decode([token]))
                parts.append(f"<span class='t' style='background:{_HTML_COLOURS[source]}' title='{label}'>"
                             f"{text}</span>")
        parts.append("</div><details><summary>steps</summary><table><tr><th>step</th><th>tree nodes</th>"
                     "<th>accepted drafts</th><th>by source</th><th>target token</th><th>time (ms)</th></tr>")
        previous = 0.0
        for index, pairs, nodes, seconds in steps:
            drafts = [source for _, source in pairs[:-1]]
            by_source = ", ".join(f"{SOURCE_NAMES[s]} {c}" for s, c in sorted(Counter(drafts).items()))
            last_token, last_source = pairs[-1]
            target = html.escape(repr(decode([last_token]))) if last_source == 0 else "(cut)"
            parts.append(f"<tr><td>{index}</td><td>{nodes}</td><td>{len(drafts)}</td><td>{by_source}</td>"
                         f"<td>{target}</td><td>{(seconds - previous) * 1e3:.1f}</td></tr>")
            previous = seconds
        parts.append("</table></details>")
    parts.append("</body></html>")
    return "".join(parts) + "\n"


def render_terminal(requests: Sequence[TracedRequest], decode: Callable[[list[int]], str]) -> str:
    """The same colouring with ANSI backgrounds, steps separated by a dim bar."""
    lines = [" ".join(f"\x1b[48;5;{_ANSI_COLOURS[s]}m\x1b[30m {SOURCE_NAMES[s]} \x1b[0m" for s in _LEGEND)]
    for number, request in enumerate(requests):
        counts = source_counts(request)
        lines.append(f"--- request {number}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        text = []
        for _, pairs, _, _ in _kept(request):
            text.append("\x1b[2m|\x1b[0m")
            for token, source in pairs:
                text.append(f"\x1b[48;5;{_ANSI_COLOURS[source]}m\x1b[30m{decode([token])}\x1b[0m")
        lines.append("".join(text))
    return "\n".join(lines) + "\n"
