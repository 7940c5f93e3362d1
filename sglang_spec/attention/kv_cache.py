"""The transformers KV cache that target and head forwards append to."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import DynamicCache


def new_dynamic_cache() -> DynamicCache:
    """An empty ``transformers.DynamicCache``."""
    # transformers is the optional `models` extra and takes seconds to import; importing it here, when the first
    # cache is made, keeps `import sglang_spec.decode` (and `sglang-spec tree`) free of it
    from transformers import DynamicCache

    return DynamicCache()
