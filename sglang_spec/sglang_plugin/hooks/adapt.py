"""Hooks of a server whose head ``sglang-spec adapt`` keeps training: the served traffic logged as token ids
(``--speculative-tree-traffic-log``, ``traffic_log``) and the head swapped in place through SGLang's own weight
updates of the draft runner, each swap the worker's ``swap_head`` event.

A swap is any successful in-place update that reached the draft runner: ``update_weights_from_tensor`` or
``update_weights_from_distributed`` with selector ``draft`` or ``all``, or ``update_weights_from_disk`` (every
runner). SGLang runs it on the scheduler's thread between two steps (``adapt`` pauses generation in place around
it), so every draft step runs with one head; requests in flight go on with their draft KV from the old head (it
only proposes: what the target verifies is unchanged). The update's ``weight_version`` labels the head.
"""

from __future__ import annotations

from typing import Any

from sglang_spec.sglang_plugin.messages import log
from sglang_spec.sglang_plugin.metrics import METRICS
from sglang_spec.sglang_plugin.state import state_of
from sglang_spec.sglang_plugin.traffic_log import ATTRIBUTE, TrafficLog, entry

# the updates that reach the draft runner: the request's selector, or every runner (disk)
DRAFT_SELECTORS = ("draft", "all")


# ------------------------------------------------------------------------------------------------ the traffic log
def tokenizer_manager_init_after(result, manager, *args, **kwargs):
    """The traffic log's writer, on SGLang's request logger (which sees every finished request)."""
    path = getattr(manager.server_args, ATTRIBUTE, None)
    if path is not None:
        setattr(manager.request_logger, ATTRIBUTE, TrafficLog(path))
        log(f"served traffic logged to {path} (token ids, for sglang-spec adapt)")
    return result


def finished_request_after(result, request_logger, obj, out, *args, **kwargs):
    """SGLang's ``RequestLogger.log_finished_request``: one finished request's line in the traffic log."""
    traffic = getattr(request_logger, ATTRIBUTE, None)
    if traffic is not None and isinstance(out, dict):
        line = entry(obj, out, str((out.get("meta_info") or {}).get("weight_version")))
        if line is not None:
            traffic.write(line)
    return result


# --------------------------------------------------------------------------------------------------- head swaps
def _swapped(manager: Any, recv_req: Any, output: Any, selector: str) -> None:
    if not getattr(output, "success", False) or selector not in DRAFT_SELECTORS:
        return
    worker = getattr(manager, "draft_worker", None)
    state = state_of(worker) if worker is not None else None
    if state is None:  # not a tree server (or no draft runner)
        return
    swap = state.swap_head(getattr(recv_req, "weight_version", None))
    METRICS.set_head(swap.version, swap.label)
    log(f"draft head swapped in place: head {swap.label} served from now on (swap {swap.version})")


def update_from_tensor_after(result, manager, recv_req, *args, **kwargs):
    _swapped(manager, recv_req, result, getattr(recv_req, "selector", "all"))
    return result


def update_from_distributed_after(result, manager, recv_req, *args, **kwargs):
    _swapped(manager, recv_req, result, getattr(recv_req, "selector", "all"))
    return result


def update_from_disk_after(result, manager, recv_req, *args, **kwargs):
    _swapped(manager, recv_req, result, "all")
    return result
