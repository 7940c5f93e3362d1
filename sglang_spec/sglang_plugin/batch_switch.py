"""``--speculative-tree-auto``: each decode step of the running batch is a tree step or a plain step, decided by
what steps of that batch size have delivered on the served traffic (no sglang import here).

A tree pays when its accepted tokens outweigh what verifying the tree and drafting it cost over a plain step; both
move with the batch size (a batch of 16 fills the target's forward, so a tree's extra tokens stop being nearly
free) and with the traffic (copy-heavy prompts accept more). So the decision is measured rather than predicted:
per batch-size bucket (1, 2, 3-4, 5-8, ...) one ``decode/switch.SpeculationSwitch``, the reference decoder's own
guard, weighs the wall time per emitted token of the bucket's recent tree steps against its plain steps'. A loss
takes a stretch of plain steps (doubling while probes keep losing), then probes trees again, so speculation
turns itself off under load and back on when the batch shrinks or the traffic starts to copy.

The switch starts without a plain-decoding time (its prior is ~0 s a token): the first verdict in a bucket
measures plain steps before it judges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_spec.decode.switch import SpeculationSwitch

_NO_PRIOR = 1e-9  # seconds a token: any tree loses against it, which measures plain steps first
# a batch step weighs every request's tokens, so fewer steps make a verdict than for one request (the reference
# decoder's window 8 / probe 4): served runs are short, and each batch size explores on its own
WINDOW, PROBE_STEPS = 4, 2


@dataclass
class BatchSwitches:
    """One SpeculationSwitch per batch-size bucket (the next power of two at or above the batch size)."""

    switches: dict[int, SpeculationSwitch] = field(default_factory=dict)
    plain_steps: int = 0  # steps decided plain so far (reported in the log and by tests)
    tree_steps: int = 0

    def switch(self, batch_size: int) -> SpeculationSwitch:
        bucket = _bucket(batch_size)
        if bucket not in self.switches:
            self.switches[bucket] = SpeculationSwitch(plain_seconds=_NO_PRIOR, window=WINDOW, probe_steps=PROBE_STEPS)
        return self.switches[bucket]

    def plain(self, batch_size: int) -> bool:
        """Whether the next step of a batch of ``batch_size`` requests is a plain step."""
        return self.switch(batch_size).lean

    def observe(self, batch_size: int, plain: bool, seconds: float, tokens: int) -> str | None:
        """A step of ``batch_size`` requests took ``seconds`` and emitted ``tokens`` (a plain step: one a
        request). Returns a line for the log when the bucket turns speculation off or back on."""
        switch = self.switch(batch_size)
        if plain:
            self.plain_steps += 1
            switch.observe_plain(seconds / max(batch_size, 1))
        else:
            self.tree_steps += 1
            switch.observe_speculative(seconds, tokens)
        if switch.lean == plain:
            return None
        state = f"plain for {switch.lean_left} steps" if switch.lean else "trees"
        return (f"tree auto, batches up to {_bucket(batch_size)}: {state} (plain decoding {switch.plain_rate():.4f} s/token; "
                f"{self.tree_steps} tree / {self.plain_steps} plain steps so far)")


def _bucket(batch_size: int) -> int:
    """The next power of two at or above the batch size."""
    return 1 << max(batch_size - 1, 0).bit_length()
