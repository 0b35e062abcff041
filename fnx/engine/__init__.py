"""Decode state, the jitted step programs, sampling, speculative decoding and generate()."""

from fnx.engine.engine import Engine, Output, SpeculativeConfig
from fnx.engine.generate import chat, generate, generate_fn, generate_jit, stream_text
from fnx.engine.sampling import SamplingParams

__all__ = ["Engine", "Output", "SamplingParams", "SpeculativeConfig", "chat", "generate", "generate_fn", "generate_jit", "stream_text"]
