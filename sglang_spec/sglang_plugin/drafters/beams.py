"""The head's forward over a draft step's beams, as SGLang's own loop runs it, and the KV row copies that give each
beam its own ancestry. Shared by every drafter that runs head rounds of its own (``head_loop``, ``host_context``,
``device_context``).

SGLang's draft attention treats a request's W beams as W sequences, beam j drafting into KV column [j][0..steps);
beams are re-chosen every step, so a beam whose parent was another beam would read that beam's history. Copying
column parent(j) into column j for the steps drafted so far (``ancestry_permutation`` + ``permute_kv``) gives
every beam exactly its own ancestors.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_spec.sglang_plugin.drafters.beam_selection import ancestry_permutation
from sglang_spec.sglang_plugin.state import LOGIT_ROWS, state_of


def supports_row_permutation(pool) -> bool:
    """True for pools whose layer buffers hold one token slot a row, ``[size + page_size, heads, dim]`` (MHA k / v in
    the NHD layout, MLA's latent), at any page size: a page is then ``page_size`` consecutive rows, a row copy
    moves one token's KV, and SGLang's paged draft layout (each beam on its own pages, ``prepare_for_draft``) gives
    every beam its own rows to permute. Pools whose rows are pages (HND, vectorized_5d) are refused."""
    if getattr(pool, "use_hnd", False) or getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        return False
    buffers = kv_buffers(pool)
    rows = getattr(pool, "size", None)
    if not buffers or rows is None:
        return False
    rows += int(getattr(pool, "page_size", 1) or 1)
    return all(buffer.dim() == 3 and buffer.shape[0] == rows for buffer in buffers)


def kv_buffers(pool) -> list[torch.Tensor]:
    """Every layer buffer of a KV pool: MHA's k and v buffers, MLA's latent buffers."""
    return [buffer for name in ("k_buffer", "v_buffer", "kv_buffer") for buffer in getattr(pool, name, None) or ()]


def permute_kv(pool, target, source) -> None:
    """pool[target] = pool[source] for every layer buffer, as a gather then a scatter (safe for permutations).
    Slot-major pools only (MHA k/v buffers, MLA latent); others are refused at start-up."""
    target, source = target.long(), source.long()
    for buffer in kv_buffers(pool):
        buffer[target] = buffer[source]


def zero_kv(pool, slots: torch.Tensor) -> None:
    """pool[slots] = 0 in every layer buffer (slot-major pools, ``supports_row_permutation``): the KV of tokens the
    head did not run over, so its attention reads nothing there rather than a slot's earlier owner."""
    slots = slots.long()
    for buffer in kv_buffers(pool):
        buffer[slots] = 0


def forward_beams(worker: Any, forward_batch: Any, step: int, input_ids: torch.Tensor, hidden: torch.Tensor,
                  out_cache_loc: torch.Tensor, topk: int,
                  logit_rows: torch.Tensor | None = None) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Draft step ``step`` >= 1 over the batch's b * W beams, exactly as SGLang's loop runs it: input_ids [b * W]
    (full-vocabulary tokens), hidden [b * W, H] (each beam's parent state), out_cache_loc [b * W] (the step's draft
    KV slots). ``logit_rows``: [R] the rows whose logits (and last hidden states) the forward returns, None for
    all. Returns SGLang's logits output and those rows' top-``topk`` candidates ([R, topk] probabilities and
    full-vocabulary tokens, best first); advances the positions by one."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.speculative.spec_utils import renorm_draft_probs

    forward_batch.input_ids = input_ids
    forward_batch.out_cache_loc = out_cache_loc
    forward_batch.spec_info.hidden_states = hidden
    backend = worker.draft_attn_backend.attn_backends[step - 1]
    token = LOGIT_ROWS.set(logit_rows)
    try:
        with forward_context(ForwardContext(attn_backend=backend), forward_batch=forward_batch):
            output = worker.draft_runner.forward(forward_batch).logits_output
    finally:
        LOGIT_ROWS.reset(token)
    probs = renorm_draft_probs(output.next_token_logits, forward_batch.sampling_info, False)
    topk_p, topk_index = torch.topk(probs, topk, dim=-1)
    faults = getattr(state_of(worker), "faults", None)
    if faults is not None and faults.poison is not None:  # tests only (faults.HeadPoison)
        topk_p = faults.poison.apply(topk_p, forward_batch.batch_size)
    if worker.hot_token_id is not None:
        topk_index = worker.hot_token_id[topk_index]
    forward_batch.positions.add_(1)
    if worker.draft_runner.model_config.model_is_mrope:
        forward_batch.mrope_positions.add_(1)
    return output, topk_p, topk_index


def head_round(worker: Any, forward_batch: Any, step: int, tokens: torch.Tensor, parent_beam: torch.Tensor,
               state: torch.Tensor, step_locs: torch.Tensor, topk: int, node_beams: torch.Tensor | None = None
               ) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One head level of a context tree over the batch's W beams, as both context paths run it: beam (r, w) is
    node token ``tokens[r, w]`` ([R, W], on the device); at step 1 every beam reads its request's root state
    (``state`` [R, H]), past it the state of its parent beam ``parent_beam[r, w]`` in the last forward (``state``
    [R * W, H]), whose KV history its own column takes first. Returns ``forward_beams``' output and top-``topk``,
    a row a beam: hidden states [R * W, H], top-k [R * W, topk].

    ``node_beams``: [N] the beams that hold a node (``r * W + w``, ascending; None: every beam). The head's layer
    runs over every beam (the draft attention's shape), its LM head over these alone (most of a round's work at a
    small hidden size); a beam of no node gets zeros for its state and candidates, which nothing reads (no node's
    parent is such a beam)."""
    batch, width = tokens.shape
    requests = torch.arange(batch, device=tokens.device)
    if step == 1:
        hidden_rows = requests.repeat_interleave(width)
    else:
        hidden_rows = (parent_beam + (requests * width)[:, None]).reshape(-1)
        target, source = ancestry_permutation(parent_beam, step_locs, step - 1)
        permute_kv(worker.draft_runner.token_to_kv_pool, target, source)
    rows = None if node_beams is None or node_beams.numel() == batch * width else node_beams
    output, topk_p, topk_index = forward_beams(worker, forward_batch, step, tokens.reshape(-1), state[hidden_rows],
                                               step_locs[step - 1], topk, rows)
    if rows is not None:
        output.hidden_states = spread_rows(output.hidden_states, rows, batch * width)
        topk_p, topk_index = spread_rows(topk_p, rows, batch * width), spread_rows(topk_index, rows, batch * width)
    return output, topk_p, topk_index


def spread_rows(values: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """[count, ...]: ``values`` ([len(rows), ...]) at ``rows``, zeros elsewhere (a forward's outputs computed for
    some of its rows, back at its full row count)."""
    spread = values.new_zeros((count, *values.shape[1:]))
    spread[rows] = values
    return spread


def pad_head_rounds(worker: Any, forward_batch: Any, done: int, steps: int, state: torch.Tensor,
                    step_locs: torch.Tensor) -> int:
    """The head rounds ``done + 1 .. steps - 1`` a draft's trees did not ask for, run over dummy beams (token 0,
    each beam reading its own column), their output unread: under DP attention every rank of a step runs the same
    ``steps - 1`` head forwards, because their DP gathers pair up across ranks and SGLang's idle ranks run that
    many (``_draft_forward_idle``). ``state``: the last round's hidden states ([R * W, H]; the root's [R, H] when
    ``done`` is 0). Returns the rounds run."""
    batch, width = forward_batch.batch_size, worker.topk
    device = state.device
    tokens = torch.zeros(batch, width, dtype=torch.int64, device=device)
    own_column = torch.arange(width, dtype=torch.int64, device=device).repeat(batch, 1)
    for step in range(done + 1, steps):
        output, _, _ = head_round(worker, forward_batch, step, tokens, own_column, state, step_locs, 1)
        state = output.hidden_states
    return max(steps - 1 - done, 0)
