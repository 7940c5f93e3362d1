"""Catches host reads and torch ops issued by our own code (sglang_spec/, its kernels included) inside a block.

Everything else is ignored: torch internals, the Triton CPU interpreter (which copies arguments around), and
the caller's own target forward. Each torch op or host read is attributed to the innermost stack frame outside
torch, and recorded when that frame is ours. ``host_only=True`` records only what a CUDA graph cannot capture:
host reads, and tensors built from host (Python) data, which are host-to-device copies on a GPU."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
OURS = (str(REPO / "sglang_spec") + "/",)
HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
HOST_DATA_OPS = ("aten.lift_fresh", "aten._to_copy")  # torch.tensor(python data); .to(device) copies


def _culprit(roots: tuple[str, ...] = OURS) -> str | None:
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if "/torch/" in name or name == __file__:
            continue
        return f"{Path(name).name}:{frame.lineno}" if name.startswith(roots) else None
    return None


class HostAccessGuard(TorchDispatchMode):
    def __init__(self, host_only: bool = False, roots: tuple[str, ...] = OURS) -> None:
        """``roots``: the folders (trailing slash) whose code is watched (default: ``sglang_spec/``)."""
        super().__init__()
        self.host_only = host_only
        self.roots = roots
        self.events: list[str] = []
        self._originals: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = _culprit(self.roots)
        if where and (not self.host_only or str(func).startswith(HOST_DATA_OPS)):
            self.events.append(f"{func} at {where}")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def patched(tensor, *args, _name=name, _original=original, **kwargs):
                where = _culprit(self.roots)
                if where:
                    self.events.append(f"Tensor.{_name} at {where}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)
