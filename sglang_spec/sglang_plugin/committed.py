"""A request's committed output while a step runs, under either of SGLang's scheduler loops.

SGLang appends a step's accepted tokens to ``req.output_ids`` when it processes the step's result. Without the
overlap scheduler that happens before the next step runs. With it (SGLang's default on a GPU) a step's result is
processed after the next step has been launched, so while a step drafts and verifies, ``output_ids`` lacks the
previous step's tokens (on a request's first decode step, the prefill's token). Two things the plugin reads on
the host need the output complete: a host context tree's history (``drafters.host_context``) and exact penalties in a
tree's verify (``penalties``). They get ``output_ids`` plus the missing tail, which this module keeps: the tokens each
verify committed (its accepted drafts and the bonus token), recorded on the device where the verify samples them
and read on the host when the next step asks (SGLang's NGRAM worker splices its previous round's tokens the same
way).

How many tokens are missing comes from SGLang's own state, not from the loop's mode: at a decode step a request's
KV holds its prompt and every committed token but the last (the root the step verifies), so
``missing = seq_len + 1 - len(prompt) - len(output_ids)``: 0 with the synchronous loop, one step's tokens with the
overlap loop. The last committed token is the root, so one missing token is the root alone; more must be the
tail of the verify recorded at that KV length, or the output is unknown (``None``: the caller keeps what it did
without, a weaker context tree or SGLang's relaxed penalties; never a wrong token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from sglang_spec.sglang_plugin.messages import log

# forget what is held for finished requests once this many more are held than the batch has
SPARE_REQUESTS = 256
# recorded verifies kept unread at most (an output is asked for the step after each record, unless its requests ended)
MAX_PENDING = 4


def forget_finished(by_rid: dict[str, Any], rids: Sequence[str]) -> None:
    """Drops the entries of requests not in ``rids`` (the batch) once ``SPARE_REQUESTS`` more than it are held:
    SGLang tells a worker of no finished request, so what it keeps by rid is bounded this way."""
    if len(by_rid) > len(rids) + SPARE_REQUESTS:
        alive = set(rids)
        for rid in [rid for rid in by_rid if rid not in alive]:
            del by_rid[rid]


@dataclass
class CommittedOutputs:
    """Per worker with the overlap scheduler on: rid -> (the request's KV length after its last verify, the tokens
    that verify committed, bonus last). ``spliced`` / ``unknown``: outputs completed from a record / not
    completable, counted for the log and the tests.

    A record reads nothing on the host: it gathers the committed tokens into fresh device tensors (``pending``),
    which are read when an output is next asked for. The asker is the next step's context draft or penalised
    verify, which has read that verify's roots by then (a sync it makes anyway), so the verify itself never
    waits for the device. A server without context trees records only batches with penalties (a request has
    them from its first step or never, and its first step needs no record: one token missing is the root)."""

    every_step: bool = False  # record every verify (a context drafter reads each step's); else penalised batches'
    spliced: int = 0
    unknown: int = 0
    reported: bool = False  # the first unknown output logged (``report_first_unknown``)
    _records: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # recorded verifies not yet read, oldest first: (rids, KV lengths after [bs], tokens [bs, steps + 1], counts [bs])
    pending: list[tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def record(self, rids: Sequence[str], seq_lens: torch.Tensor, predict: torch.Tensor, accept_index: torch.Tensor,
               accept_lens: torch.Tensor) -> None:
        """After a verify (SGLang's ``eagle_sample`` outputs): seq_lens [bs], the KV lengths it verified after;
        predict [bs * N], the target's token after each node; accept_index [bs, steps + 1], each request's accepted
        nodes (global indices, -1 padded); accept_lens [bs], the tokens each committed (accepted drafts + bonus)."""
        # fresh tensors: SGLang's (or the fused accept's) buffers may be rewritten before they are read
        self.pending.append((list(rids), seq_lens.to(accept_lens.device) + accept_lens,
                             predict[accept_index.clamp(min=0).long()], accept_lens.clone()))
        if len(self.pending) > MAX_PENDING:  # verifies nobody asked about (finished requests): long done, read them
            self._read(len(self.pending) - MAX_PENDING)

    @property
    def records(self) -> dict[str, tuple[int, list[int]]]:
        """rid -> (KV length after its last recorded verify, the tokens it committed), every pending verify read."""
        self._read(len(self.pending))
        return self._records

    def _read(self, count: int) -> None:
        """Reads the oldest ``count`` pending verifies into the records (host reads, in recording order)."""
        for rids, kv_after, tokens, lengths in self.pending[:count]:
            kv_after_list, lengths_list, token_rows = kv_after.tolist(), lengths.tolist(), tokens.tolist()
            for row, rid in enumerate(rids):
                self._records[rid] = (int(kv_after_list[row]),
                                      [int(token) for token in token_rows[row][:lengths_list[row]]])
            forget_finished(self._records, rids)
        del self.pending[:count]

    def output(self, req: Any, kv_length: int, root: int) -> list[int] | None:
        """``req``'s committed output at a decode step whose KV holds ``kv_length`` of its tokens and which
        verifies from ``root`` (the output's last token); None when it cannot be known."""
        tail = self.tail(req, kv_length, root)
        return None if tail is None else list(req.output_ids) + tail

    def tail(self, req: Any, kv_length: int, root: int) -> list[int] | None:
        """The committed tokens ``req.output_ids`` lacks at that step, in order ([] where it is whole), read
        without copying the output: ``output`` is ``output_ids + tail``. None when it cannot be known."""
        output = req.output_ids
        missing = kv_length + 1 - len(req.origin_input_ids) - len(output)  # the KV's prompt: image padding included
        if missing == 0:
            return [] if len(output) and output[-1] == root else None
        if missing == 1:  # the root alone: a request's first decode step after its prefill, or a plain step's
            self.spliced += 1
            return [root]
        recorded = self.records.get(req.rid)
        if missing < 0 or recorded is None or recorded[0] != kv_length or len(recorded[1]) < missing \
                or recorded[1][-1] != root:
            self.unknown += 1
            return None
        self.spliced += 1
        return recorded[1][len(recorded[1]) - missing:]

    def report_first_unknown(self) -> None:
        """The first output this could not complete, in one log line (the tests assert there is none)."""
        if self.unknown and not self.reported:
            self.reported = True
            log("overlap scheduler: a request's committed output could not be completed from its last verify; its "
                "tree falls back to the output ids SGLang has processed (penalties: SGLang's relaxed ones)")
