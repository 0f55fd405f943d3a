"""autoprofile: an LLM serving runtime that sizes its KV cache from a measured two-pass profile."""
__version__ = "0.1.0"
