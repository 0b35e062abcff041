"""Decode state, the jitted step programs, sampling, speculative decoding and generate()."""

from fnx.engine.engine import Engine, Output, SpeculativeConfig
from fnx.engine.generate import generate, generate_fn, generate_jit
from fnx.engine.sampling import SamplingParams

__all__ = ["Engine", "Output", "SamplingParams", "SpeculativeConfig", "generate", "generate_fn", "generate_jit"]
