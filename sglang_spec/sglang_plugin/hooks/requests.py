"""Hooks of a request's admission in SGLang's tokenizer manager: what SGLang would hand its scheduler but no
forward can serve is refused there, in one line, through SGLang's own error path.

``TokenizerManager._validate_one_request`` sees every generate request of every route (``/generate`` one prompt or a
batch, ``/v1/completions``, ``/v1/chat/completions``, ``sgl.Engine``) once its prompt is final: tokenized, chat
template applied, multimodal placeholders expanded. A ``ValueError`` raised there is answered by SGLang's routes
with HTTP 400 and its message, and a batch member's refusal aborts the members already sent. A plain server is
guarded too: the plugin hooks SGLang whether or not the tree options are set.

Refused:

* an empty prompt (0 tokens: ``text: ""`` with a tokenizer that adds no BOS, a batch member ``""`` or ``[]``, a
  completion's empty prompt). SGLang 0.5.23 schedules it as a 0-token prefill, which no attention or rotary kernel
  is written for (on the CPU the scheduler died in the rotary embedding's reshape, and the server with it). A
  request continuing a session (``session_params`` with an id) is left to SGLang: its history supplies the prompt.

A fault in the check itself is counted and logged in one line (``faults.plugin_fault``) and the request goes on to
SGLang's own validation, as without the plugin.
"""

from __future__ import annotations

from typing import Any, Sequence

from sglang_spec.sglang_plugin.faults import REQUEST, plugin_fault

EMPTY_PROMPT = ("the prompt is empty (0 tokens): send at least one token of text or input_ids (in a batch, every "
                "prompt)")


def validate_one_request_around(original, manager, obj, input_ids, *args, **kwargs):
    """SGLang's validation of one request (a batch member), after the plugin's own (``refusal``)."""
    try:
        refused = refusal(obj, input_ids)
    except Exception as error:  # the check must not refuse or fail a request it could not judge
        plugin_fault(REQUEST, error, "one request", "checked by SGLang's validation alone")
        refused = None
    if refused is not None:
        raise ValueError(refused)
    return original(manager, obj, input_ids, *args, **kwargs)


def refusal(obj: Any, input_ids: Sequence[int] | None) -> str | None:
    """Why SGLang must not schedule the request ``obj`` (a ``GenerateReqInput`` or ``EmbeddingReqInput`` of one
    prompt) whose final prompt is ``input_ids`` (None: given as ``input_embeds``), or None to let it through."""
    if input_ids is None or len(input_ids) > 0:
        return None
    if _session_id(obj) is not None:
        return None
    return EMPTY_PROMPT


def _session_id(obj: Any) -> Any:
    params = getattr(obj, "session_params", None)
    return params.get("id") if isinstance(params, dict) else getattr(params, "id", None)
