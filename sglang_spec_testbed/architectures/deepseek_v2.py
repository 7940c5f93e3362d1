"""The tiny DeepSeek-V3 target (``DeepseekV3ForCausalLM``: MLA + MoE)."""
from sglang.srt.models.deepseek_v2 import EntryClass  # noqa: F401
