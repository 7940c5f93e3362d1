"""Each request's committed tokens on the device, for ``lookup`` trees grown there (``device_trees/lookup``): the
prompt and the output, the root last, in the row of SGLang's ``req_to_token`` table the request holds.

Written twice, never read on the host:

* ``admit``, at a draft: a request new to its row gets the prompt and output ids the host has (an H2D copy);
  where the output ids lag the KV (SGLang's overlap scheduler: a request's first decode step precedes the
  processing of its prefill's token), the root is copied in from the device.
* ``append``, after each verify: the tokens it committed (accepted drafts and the bonus, which is the next root)
  are scattered from SGLang's ``predict`` / ``accept_index`` / ``accept_length`` onto each row's end.

A row holds what its request committed as long as every verify of the request is appended, which the plugin's
accept hook does for every batch of a ``lookup`` server. A history that came out wrong anyway (a request
re-prefilled into its old row, say) shapes weaker trees, never a wrong token: verification reads the target.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class DeviceHistory:
    """tokens [rows, columns + 1] int64 (a spare last column takes masked writes); lengths [rows] int64;
    ``owner``: row -> the rid written there (host)."""

    def __init__(self, rows: int, columns: int, device: torch.device | str) -> None:
        self.tokens = torch.full((rows, columns + 1), -1, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.int64, device=device)
        self.columns = columns
        self.owner: dict[int, str] = {}
        self.admitted = 0  # requests written from the host (tests, the log)

    def admit(self, reqs: Sequence[Any], seq_lens_cpu: torch.Tensor | None, roots: torch.Tensor) -> None:
        """Writes the rows of ``reqs`` (in batch order; a row is SGLang's ``req.kv.req_pool_idx``) that hold another
        request's history. ``seq_lens_cpu``: the batch's KV lengths on the host where SGLang keeps them (a decode
        step's KV holds every committed token but the root); without them a request with no output ids yet is
        taken to lag by its root. ``roots`` [bs]: the step's roots (device)."""
        lengths = None if seq_lens_cpu is None else seq_lens_cpu.tolist()  # a host tensor: no device read
        for row, req in enumerate(reqs):
            slot = int(req.kv.req_pool_idx)
            if self.owner.get(slot) == req.rid:
                continue
            tokens = list(req.origin_input_ids_unpadded) + list(req.output_ids)
            tokens = tokens[: self.columns - 1]
            missing_root = not req.output_ids if lengths is None else int(lengths[row]) + 1 - len(tokens) == 1
            self.tokens[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64).to(self.tokens.device)
            if missing_root:
                self.tokens[slot, len(tokens): len(tokens) + 1].copy_(roots[row: row + 1])
            self.lengths[slot] = len(tokens) + int(missing_root)
            self.owner[slot] = req.rid
            self.admitted += 1

    def append(self, slots: torch.Tensor, predict: torch.Tensor, accept_index: torch.Tensor,
               accept_length: torch.Tensor) -> None:
        """After a verify (SGLang's ``eagle_sample`` outputs, device tensors): slots [bs], each request's
        ``req_pool_idx``; predict [bs * N], the target's token after each node; accept_index [bs, steps + 1], the
        accepted nodes (global indices, -1 padded); accept_length [bs], the tokens committed (drafts + bonus)."""
        slots = slots.long()
        committed = predict[accept_index.clamp(min=0).long()].long()  # [bs, steps + 1]
        offsets = torch.arange(committed.shape[1], device=committed.device)
        counts = accept_length.long()
        position = self.lengths[slots][:, None] + offsets[None, :]
        keep = (offsets[None, :] < counts[:, None]) & (position < self.columns)
        target = torch.where(keep, position, torch.full_like(position, self.columns))
        self.tokens[slots[:, None].expand_as(target), target] = committed
        self.lengths[slots] = torch.clamp(self.lengths[slots] + counts, max=self.columns)
