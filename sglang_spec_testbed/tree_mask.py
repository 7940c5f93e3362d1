"""The CPU bed's tree-mask layout: which one SGLang builds for a tree verify and the extend-attention stand-in reads.

SGLang picks the layout once per worker in ``eagle_utils.default_tree_mask_mode()``: ``QLEN_ONLY`` on a CPU
(sgl-kernel's CPU extend attention reads a per-request ``n x n`` block, the prefix always visible) and
``FULL_MASK`` on a GPU (a per-request ``n x (prefix + n)`` block, row-major, requests concatenated: what the
FlashInfer / Triton / FA3 backends read). ``SGLANG_SPEC_CPU_TREE_MASK`` (read once, at start-up) makes the bed run
the GPU's layout end to end:

* ``full``: ``default_tree_mask_mode`` is replaced (a HookRegistry REPLACE, which SGLang propagates to every
  module that imported it by name: the EAGLE v2 workers, ``verify_mask``, ...), so SGLang's workers build
  ``FULL_MASK`` trees on their own code path (``build_tree_kernel_efficient``, sized by ``seq_lens_sum``), and
  SGLang's NGRAM worker builds its prefix-wide mask too (it skips it on a CPU only: ``USE_FULL_MASK and not
  _is_cpu``);
* ``qlen``: SGLang's CPU choice, stated explicitly; unset: SGLang decides (``QLEN_ONLY`` on a CPU).

Whatever the mode, the ``intel_amx`` backend's extend attention is bound, when the backend is built, to the mode
SGLang's ``default_tree_mask_mode()`` returns (sgl-kernel's op has no argument for it; the backend holds the op as
an attribute, ``extend_attention_fwd``), so the stand-in reads exactly the layout the workers build, and refuses a
mask too small for it. The first tree mask of each mode a process builds and the first it reads are said in one
log line each (``first_use``): the server tests check them.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.messages import log
from sglang_spec.tree.encode_sglang import TreeMaskMode

TREE_MASK_ENV = "SGLANG_SPEC_CPU_TREE_MASK"
MODES = {"qlen": TreeMaskMode.QLEN_ONLY, "full": TreeMaskMode.FULL_MASK}

_DEFAULT_MODE = "sglang.srt.speculative.eagle_utils.default_tree_mask_mode"
_AMX_INIT = "sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.__init__"
_NGRAM_INIT = "sglang.srt.speculative.ngram_worker.NGRAMWorker.__init__"

_first_uses: set[tuple[str, TreeMaskMode | None]] = set()  # (built / read, mode) already said in this process


def mode_from_environment(environment=None) -> TreeMaskMode | None:
    """The mode ``SGLANG_SPEC_CPU_TREE_MASK`` names, None when unset (SGLang's own choice). A bad name is one line
    (``SpecError``); ``activate`` checks it before SGLang starts."""
    environment = os.environ if environment is None else environment
    name = environment.get(TREE_MASK_ENV, "").strip()
    if not name:
        return None
    if name not in MODES:
        raise SpecError(f"{TREE_MASK_ENV}={name!r} is not a tree-mask mode; use one of {', '.join(MODES)} or unset it")
    return MODES[name]


def hooks(mode: TreeMaskMode | None) -> list[tuple[str, Callable, str]]:
    """(target, hook, HookType name) for SGLang's HookRegistry: the backend's binding always; with a mode, SGLang's
    choice replaced by it (and, for FULL_MASK, NGRAM's prefix-wide mask built on this CPU as on a GPU)."""
    registered: list[tuple[str, Callable, str]] = [(_AMX_INIT, amx_backend_init_after, "AFTER")]
    if mode is not None:
        registered.append((_DEFAULT_MODE, functools.partial(default_tree_mask_mode_cpu, mode), "REPLACE"))
    if mode == TreeMaskMode.FULL_MASK:
        registered.append((_NGRAM_INIT, ngram_worker_init_before, "BEFORE"))
    return registered


def default_tree_mask_mode_cpu(mode: TreeMaskMode):
    """SGLang's ``default_tree_mask_mode`` on the bed: the mode the switch names, as SGLang's own enum."""
    from sglang.srt.speculative.eagle_utils import TreeMaskMode as SGLangTreeMaskMode

    return SGLangTreeMaskMode(int(mode))


def amx_backend_init_after(result, backend, *args, **kwargs):
    """After ``IntelAMXAttnBackend.__init__``: the extend attention it holds (the bed's stand-in,
    ``attention.extend_attention_cpu``) reads tree masks in the mode SGLang's workers build them
    (``default_tree_mask_mode()``, replaced or not)."""
    from sglang.srt.speculative import eagle_utils

    mode = TreeMaskMode(int(eagle_utils.default_tree_mask_mode()))
    backend.extend_attention_fwd = functools.partial(backend.extend_attention_fwd, tree_mask_mode=mode)
    return result


def ngram_worker_init_before(worker, *args, **kwargs):
    """Before ``NGRAMWorker.__init__`` (FULL_MASK only): SGLang's NGRAM worker builds its prefix-wide verify mask
    unless it runs on a CPU; its module's ``_is_cpu`` gates only those two branches (building the mask's prefix
    columns and concatenating them with the corpus's ``n x n`` block), so it is cleared for the worker to build
    the GPU's layout."""
    from sglang.srt.speculative import ngram_worker

    ngram_worker._is_cpu = False
    return None


def first_use(what: str, mode: TreeMaskMode | None, detail: str) -> None:
    """One log line the first time this process builds (``what`` = "built") or reads ("read") a tree mask of
    ``mode``, or meets another first (``mode`` None: "CPU bed: first {what} ({detail})")."""
    key = (what, mode)
    if key in _first_uses:
        return
    _first_uses.add(key)
    log(f"CPU bed: first {what} ({detail})" if mode is None else f"CPU bed: first {mode.name} tree mask {what} "
                                                                  f"({detail})")
