"""Ragged verify: each request's verify forward covers its own tree, not SGLang's fixed width.

SGLang verifies ``width`` tokens a request (``speculative_num_draft_tokens``), so a request whose tree is smaller
gets filler leaves (``drafters.padding``) and the forward computes them. The plugin's drafters place every
request's real nodes first (node order is verify order: the root, then its tree, then fillers), so a request's
real tree is a prefix of its verify block. A ragged step keeps SGLang's dense ``[bs, width]`` layout for
everything after the forward (accept, KV move, penalties, metrics) and changes three things:

* **the links** (``unlink_fillers``): no node's first child or next sibling is a filler, so no accept (greedy or
  sampled) reaches a filler node, whose logits the forward no longer computes;
* **the forward** (``compact_forward``): the target's verify forward runs over the ``sum(lengths)`` real tokens
  (their ids, positions, KV slots, and the tree mask's real rows and columns), the attention back-end told each
  request's length (``ragged_extend_metadata``); its logits and hidden states are scattered back into the dense
  rows (filler rows zero: nothing reads them);
* **nothing else**: the KV slots of a request's window stay allocated as SGLang allocated them; a filler's slot is
  never written, and never read (the real nodes' attention reads their own prefix of the window).

Ragged steps run where the target's attention back-end takes per-request lengths in a verify forward (SGLang's CPU
back-end, ``intel_amx``; the plugin's MLA tree verify on FlashInfer, ``--speculative-tree-mla-verify``), without DP
attention (its gathers are sized by the dense token count) and with an unpacked tree mask. Elsewhere the step is
dense, as SGLang runs it.

**Under decode graphs** a ragged step replays SGLang's own ragged verify graphs (SGLang's compact mode, which it
keeps for DSpark: ``DecodeCudaGraphRunner.ragged_verify_mode``): a tree server's target verify runners wider than
one token are built in that mode where the back-end plans a ragged layout inside a graph
(``supports_ragged_verify_graph``; ``compact_graphs_wanted``), so their graphs are captured per tier of total verify
tokens (the captured batch sizes times the width), each over ``min(tier, largest batch)`` request slots. A step's
forward is then padded to its tier (pad tokens: id 0, position 0, KV slot 0, SGLang's padding slot) and carries
SGLang's ``RaggedVerifyLayout`` (``spec_info.ragged_verify_layout``), which the runner stages into the captured
graph's layout (the pad slots share the leftover tokens, each at most the width) and the back-end reads in its
replay metadata; a dense step carries one too (every length the width). A step whose tier or batch no graph holds
runs eager (no layout: the runner leaves a compact-mode verify without one to the eager forward).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_spec.sglang_plugin.drafters.choose import drafter_class
from sglang_spec.sglang_plugin.messages import log
from sglang_spec.sglang_plugin.peers import dp_attention
from sglang_spec.sglang_plugin.state import options_of
from sglang_spec.tree.encode_sglang import TreeMaskMode, complete_tree_mask, tree_mask_cells

# the attribute of a verify input that carries its step's RaggedVerify (set by the draft hook)
RAGGED_ATTRIBUTE = "sglang_spec_ragged"
# the attribute of the compacted forward's spec_info that tells the attention back-end the lengths
FORWARD_ATTRIBUTE = "sglang_spec_ragged_forward"
# back-ends whose verify forward takes per-request lengths: SGLang's CPU one (its metadata from
# ``ragged_extend_metadata``) and the plugin's MLA cascade (``mla_tree_backend``, from the forward's RaggedVerify)
RAGGED_BACKENDS = ("IntelAMXAttnBackend", "MLATreeVerifyBackend")
# set while a decode graph runner is built: whether it is built in SGLang's compact ragged mode
# (``compact_graphs_wanted``), read by SGLang's ``ragged_verify_compact_graphs_enabled`` in the runner's constructor
COMPACT_GRAPHS: contextvars.ContextVar[bool] = contextvars.ContextVar("sglang_spec_compact_graphs", default=False)


@dataclass(frozen=True, eq=False)
class RaggedVerify:
    """One step's per-request verify lengths.

    lengths: per request (batch order), the tokens its forward computes: the root and its real draft nodes,
             1..width (host ints).
    width:   tokens a request holds in SGLang's dense verify layout (``draft_token_num``).
    rows:    [sum(lengths)] int64, on the verify's device: the dense row ``b * width + k`` of each computed token,
             ``k < lengths[b]``, in batch order."""

    lengths: tuple[int, ...]
    width: int
    rows: torch.Tensor

    @classmethod
    def of(cls, lengths: Sequence[int], width: int, device: torch.device | str) -> RaggedVerify:
        if any(length < 1 or length > width for length in lengths):
            raise ValueError(f"verify lengths are 1..{width} (the root and the real nodes), got {list(lengths)}")
        rows = [row * width + k for row, length in enumerate(lengths) for k in range(length)]
        return cls(tuple(int(length) for length in lengths), width,
                   torch.tensor(rows, dtype=torch.int64).to(device))

    def lengths_tensor(self) -> torch.Tensor:
        """[bs] int64 on the rows' device."""
        return torch.tensor(self.lengths, dtype=torch.int64).to(self.rows.device)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def dense(self) -> bool:
        """Whether every request verifies its whole block (the step is SGLang's own)."""
        return all(length == self.width for length in self.lengths)


def unlink_fillers(next_token: torch.Tensor, next_sibling: torch.Tensor,
                   lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's tree links (``retrieve_next_token`` / ``retrieve_next_sibling``, [bs, width] int64, node indices
    within a request's block, -1 for none) with every node at or past ``lengths`` [bs] (a filler: a leaf) left out:
    a link to a filler goes on along the filler's siblings to the next real one (or -1), and a filler's own links
    are -1. No host read: ``width`` rounds of gathers, each following one more filler."""
    width = next_token.shape[1]
    bound = lengths.to(next_token.device, torch.int64)[:, None]
    nodes = torch.arange(width, device=next_token.device)[None, :]
    filler = nodes >= bound

    def past_fillers(links: torch.Tensor) -> torch.Tensor:
        for _ in range(width):
            at_filler = links >= bound
            links = torch.where(at_filler, torch.gather(next_sibling, 1, links.clamp(min=0)), links)
        return links

    siblings = past_fillers(next_sibling).masked_fill(filler, -1)
    next_sibling = siblings  # the first child's skip reads the fixed sibling chain
    children = past_fillers(next_token).masked_fill(filler, -1)
    return children, siblings


def compact_mask(mask: torch.Tensor, mode: TreeMaskMode, prefix_lens: Sequence[int], width: int,
                 lengths: Sequence[int]) -> torch.Tensor:
    """A dense tree mask (flat, ``mode``'s layout, ``width`` tokens a request after ``prefix_lens`` committed
    ones) cut to each request's first ``lengths[b]`` tokens: QLEN_ONLY blocks ``width x width`` -> ``n x n``,
    FULL_MASK blocks ``width x (prefix + width)`` -> ``n x (prefix + n)``. Packed masks are not cut
    (``ValueError``: the step stays dense)."""
    if mode not in (TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK):
        raise ValueError(f"a {mode.name} tree mask is not cut per request")
    blocks = mask.split(tree_mask_cells(mode, prefix_lens, [width] * len(lengths)))  # the layout's own cells
    pieces = []
    for block, length in zip(blocks, lengths):
        rows = block.view(width, -1)
        pieces.append(rows[:length, : rows.shape[1] - width + length].reshape(-1))
    return torch.cat(pieces)


def graph_tier(graph_runner, ragged: RaggedVerify) -> int | None:
    """The token tier of ``graph_runner``'s ragged verify graphs (``DecodeCudaGraphRunner`` in SGLang's compact
    mode) that replays this step: the smallest captured tier holding its tokens, None where the runner is not in
    that mode or no graph holds the step (more tokens than the largest tier, more requests than its slots)."""
    if graph_runner is None or not getattr(graph_runner, "ragged_verify_mode", False):
        return None
    from sglang.srt.speculative.ragged_verify import round_up_grid

    tiers = graph_runner.capture_num_tokens
    if ragged.total > tiers[-1]:
        return None
    tier = round_up_grid(ragged.total, tiers)
    return tier if len(ragged.lengths) <= graph_runner._ragged_capture_slots(tier) else None


def compacted_batch(forward_batch, ragged: RaggedVerify, mode: TreeMaskMode, tiers: Sequence[int] | None = None,
                    tier: int | None = None) -> None:
    """``forward_batch`` (a dense TARGET_VERIFY batch) cut to the ragged tokens in place: ids, positions, KV slots,
    and a copy of its spec_info with the cut tree mask and the lengths (``FORWARD_ATTRIBUTE``). With a graph
    ``tier`` (one of ``tiers``, the runner's): the tokens padded to it and SGLang's ``RaggedVerifyLayout`` on the
    spec_info (see the module docstring)."""
    rows = ragged.rows
    pad = 0 if tier is None else tier - ragged.total
    forward_batch.input_ids = _padded(forward_batch.input_ids[rows], pad)
    forward_batch.positions = _padded(forward_batch.positions[rows], pad)
    forward_batch.out_cache_loc = _padded(forward_batch.out_cache_loc[rows], pad)
    spec_info = copy.copy(forward_batch.spec_info)
    mask = spec_info.custom_mask
    if mask is not None and mask.numel() > 0:
        prefix_lens = forward_batch.seq_lens_cpu.tolist()
        spec_info.custom_mask = compact_mask(mask, mode, prefix_lens, ragged.width, ragged.lengths)
    setattr(spec_info, FORWARD_ATTRIBUTE, ragged)
    if tier is not None:
        from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

        assert tiers is not None
        spec_info.ragged_verify_layout = RaggedVerifyLayout.from_verify_lens(
            verify_lens_cpu=ragged.lengths, device=rows.device, grid=tiers, graph_num_tokens_floor=tier)
    forward_batch.spec_info = spec_info


def _padded(values: torch.Tensor, pad: int) -> torch.Tensor:
    """``values`` [n] with ``pad`` zeros after (a graph tier's pad tokens: id 0, position 0, SGLang's KV slot 0)."""
    return values if pad == 0 else torch.cat([values, values.new_zeros(pad)])


def scatter_dense(values: torch.Tensor | None, ragged: RaggedVerify) -> torch.Tensor | None:
    """[sum(lengths), ...] rows of the compacted forward (or [tier, ...], the tier's pad rows last) -> [bs * width,
    ...], filler rows zero."""
    if values is None or values.shape[0] < ragged.total:
        return values
    dense = values.new_zeros((len(ragged.lengths) * ragged.width, *values.shape[1:]))
    dense.index_copy_(0, ragged.rows, values[:ragged.total])
    return dense


@contextlib.contextmanager
def compact_forward(target_worker, ragged: RaggedVerify, mode: TreeMaskMode):
    """For this verify: the target's forward over the ragged tokens, its logits and hidden states back in SGLang's
    dense rows. An instance attribute over the method, as tree auto's plain step does (``hooks.auto``)."""
    forward = target_worker.forward_batch_generation

    def ragged_forward(forward_batch=None, is_verify: bool = False, **kwargs):
        if not (is_verify and forward_batch is not None and forward_batch.forward_mode.is_target_verify()):
            return forward(forward_batch=forward_batch, is_verify=is_verify, **kwargs)
        graph_runner = target_worker.model_runner.decode_cuda_graph_runner  # the step's size's (``verify_shapes``)
        tier = graph_tier(graph_runner, ragged)
        compacted_batch(forward_batch, ragged, mode, None if tier is None else graph_runner.capture_num_tokens, tier)
        output = forward(forward_batch=forward_batch, is_verify=is_verify, **kwargs)
        logits = output.logits_output
        logits.next_token_logits = scatter_dense(logits.next_token_logits, ragged)
        logits.hidden_states = scatter_dense(logits.hidden_states, ragged)
        return output

    shadowed = vars(target_worker).get("forward_batch_generation")  # another step-scoped override, kept
    target_worker.forward_batch_generation = ragged_forward
    try:
        yield
    finally:
        if shadowed is None:
            del target_worker.forward_batch_generation
        else:
            target_worker.forward_batch_generation = shadowed


def forward_ragged(forward_batch) -> RaggedVerify | None:
    """The lengths of a compacted verify forward (``compacted_batch``), None for any other forward: what an
    attention back-end reads to verify each request's own tree."""
    if not forward_batch.forward_mode.is_target_verify():
        return None
    return getattr(forward_batch.spec_info, FORWARD_ATTRIBUTE, None)


def ragged_extend_metadata(forward_batch, device) -> tuple | None:
    """(seq_lens, extend_seq_lens, extend_start_loc, tree_mask) of a compacted verify forward for SGLang's CPU
    back-end (its ``_build_extend_metadata``), None for any other forward. A forward carrying SGLang's
    ``RaggedVerifyLayout`` (a graph tier's, captured or staged for a replay: one length per request slot, the pad
    slots' included) is read from the layout; its tree mask holds each real request's cut block, the pad tokens'
    cells attending everywhere (``tier_mask``)."""
    if not forward_batch.forward_mode.is_target_verify():
        return None
    spec_info = forward_batch.spec_info
    layout = getattr(spec_info, "ragged_verify_layout", None)
    ragged = getattr(spec_info, FORWARD_ATTRIBUTE, None)
    if layout is None and ragged is None:
        return None
    if layout is not None:
        lengths = layout.verify_lens.to(device, torch.int32)
    else:
        lengths = torch.tensor(ragged.lengths, dtype=torch.int32).to(device)
    starts = torch.zeros_like(lengths)
    starts[1:] = torch.cumsum(lengths, 0)[:-1]
    mask = spec_info.custom_mask if spec_info.tree_topk != 1 else None
    tree_mask = mask if mask is not None and mask.numel() > 0 else None
    if tree_mask is not None and layout is not None:
        from sglang.srt.speculative.eagle_utils import default_tree_mask_mode  # the workers' layout (one a process)

        mode = TreeMaskMode(int(default_tree_mask_mode()))
        tree_mask = tier_mask(tree_mask if ragged is not None else None, mode, forward_batch.seq_lens.tolist(),
                              None if ragged is None else ragged.lengths, lengths.tolist(), tree_mask.device)
    return forward_batch.seq_lens + lengths, lengths, starts, tree_mask


def staged_lengths(layout, slots: int, width: int) -> tuple[int, ...]:
    """The lengths of a graph's ``slots`` request slots that SGLang's runner stages for a live ``RaggedVerifyLayout``
    (``DecodeCudaGraphRunner._stage_ragged_verify_layout``: the pad slots share the tier's leftover tokens, or the
    last request takes them, each at most ``width``), from its host lengths: what a back-end planning on the host
    reads (a capture's layout is its own staging)."""
    from sglang.kernels.ops.speculative.ragged_verify_kernels import pad_verify_lens_to_bucket

    if layout.verify_lens_cpu is None:
        raise ValueError("a ragged verify layout without host lengths: the plan would read them from the device")
    lengths = torch.tensor(layout.verify_lens_cpu, dtype=torch.int32)
    padded = pad_verify_lens_to_bucket(verify_lens=lengths, graph_num_tokens=layout.graph_num_tokens,
                                       bs=len(lengths), padded_bs=slots)
    return tuple(int(length) for length in padded.clamp(max=width).tolist())


def tier_mask(cut: torch.Tensor | None, mode: TreeMaskMode, prefix_lens: Sequence[int],
              real_lengths: Sequence[int] | None, lengths: Sequence[int],
              device: torch.device | str = "cpu") -> torch.Tensor:
    """The tree mask of a graph tier's forward (``mode``'s layout, one block a request slot of ``lengths[b]``
    tokens after ``prefix_lens[b]`` committed ones) from ``cut``, the real requests' cut blocks (of
    ``real_lengths``): a real request the runner's staging gave pad tokens (the last one, where no slot is left
    for them) keeps its block, its rows blind to the pad tokens, the pad rows attending everywhere; the pad slots
    are completed as a padded batch is (``complete_tree_mask``: attend-everything cells). ``cut`` None (a capture):
    every cell attends everywhere (on ``device``)."""
    if cut is None or real_lengths is None:
        return torch.ones(sum(tree_mask_cells(mode, list(prefix_lens), list(lengths))), dtype=torch.bool,
                          device=device)
    count = len(real_lengths)
    if any(length < real for real, length in zip(real_lengths, lengths)) or len(lengths) < count:
        raise ValueError(f"a tier's lengths {list(lengths)} cut the trees of {list(real_lengths)} tokens")
    prefixes = list(prefix_lens[:count]) if mode == TreeMaskMode.FULL_MASK else [0] * count
    blocks = list(cut.split(tree_mask_cells(mode, list(prefix_lens[:count]), list(real_lengths))))
    for slot, (prefix, real, length) in enumerate(zip(prefixes, real_lengths, lengths)):
        if length > real:  # the runner's staging gave this request pad tokens: only their rows see them
            block = blocks[slot].view(real, prefix + real)
            widened = block.new_ones((length, prefix + length))
            widened[:real] = torch.nn.functional.pad(block, (0, length - real))
            blocks[slot] = widened.reshape(-1)
    return complete_tree_mask(torch.cat(blocks), mode, list(prefix_lens), list(lengths))


def compact_graphs_wanted(model_runner, attn_backend, width: int) -> bool:
    """Whether a decode graph runner of ``model_runner`` verifying ``width`` tokens a request is built in SGLang's
    compact ragged mode (module docstring): a tree server's target runner wider than one token, whose drafter grows
    ragged trees, on a back-end that plans a ragged layout in a graph, with an unpacked tree mask and without DP
    attention. Read once per runner, at its construction."""
    options = options_of(getattr(model_runner, "server_args", None))
    if options is None or model_runner.is_draft_worker or width <= 1 or not drafter_class(options).ragged_trees:
        return False
    from sglang.srt.speculative.eagle_utils import default_tree_mask_mode

    if not getattr(attn_backend, "supports_ragged_verify_graph", False):
        return False
    return ragged_refusal(attn_backend, None, default_tree_mask_mode(), dp_attention()) is None


def ragged_refusal(attn_backend, graph_runner, mask_mode, dp_attention: bool) -> str | None:
    """Why a server's verify forwards stay at SGLang's width (None: ragged verify runs)."""
    backend = type(attn_backend).__name__
    if backend not in RAGGED_BACKENDS:
        return f"the target's attention back-end {backend} takes one verify width"
    if dp_attention:
        return "DP attention gathers every rank's tokens at one verify width"
    if int(mask_mode) not in (TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK):
        return f"a {TreeMaskMode(int(mask_mode)).name} tree mask is not cut per request"
    if graph_runner is not None and not graph_runner.ragged_verify_mode:  # the reasons above come first
        return f"decode graphs are captured at one verify width ({backend} plans no ragged layout inside a graph)"
    return None


def decide(state, draft_worker) -> bool:
    """Whether the server (``state``: its ``WorkerState``) verifies ragged, decided at the first of its hooks that
    asks, once the target's attention back-end and decode graphs exist (the first decode step), and said once:
    never for a drafter whose trees are not ragged (``ServedDrafter.ragged_trees``)."""
    if state.ragged is None and state.drafter.ragged_trees:
        target = draft_worker.target_worker.model_runner
        refusal = ragged_refusal(target.attn_backend, target.decode_cuda_graph_runner, draft_worker.tree_mask_mode,
                                 dp_attention())
        graphs = target.decode_cuda_graph_runner is not None
        log(("ragged verify: each request's verify forward covers its own tree, not its fillers"
             + (" (decode graphs: SGLang's ragged verify graphs, one a tier of total verify tokens)" if graphs else ""))
            if refusal is None else f"ragged verify: off, every request verifies the full width ({refusal})")
        state.ragged = refusal is None
    return bool(state.ragged)
