"""Attention math for tree verification that does not depend on an engine: the cascade (prefix + tree) split."""
