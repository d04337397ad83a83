"""Penelope: position-aware KV-cache eviction for agentic LLM serving."""

__version__ = "0.1.0"
