"""The reference tree-speculative decoder (Hugging Face target, MTP drafter, any tree policy)."""
