"""Stand-ins for sgl-kernel's CPU ops on DeepSeek-V3's MoE and MLA paths (pure torch)."""

from __future__ import annotations

STAND_INS: dict = {}
