"""SmolLM2 and the other Llama-family targets (``LlamaForCausalLM``)."""
from sglang.srt.models.llama import EntryClass  # noqa: F401
