"""DeepSeek-V3's MTP module as SGLang's NEXTN draft (``DeepseekV3ForCausalLMNextN``)."""
from sglang.srt.models.deepseek_nextn import EntryClass  # noqa: F401
