"""The OpenAI-compatible server (not implemented yet)."""
