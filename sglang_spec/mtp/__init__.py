"""The MTP head (DeepSeek-V3 layout on any decoder-only target), its checkpoint formats and the tree drafter."""
