"""fnx: a JAX inference engine for Qwen3.8-Flash-Next (`qwen4_exp`)."""

from fnx.config import ConfigError, ModelConfig
from fnx.engine import Engine, SamplingParams, SpeculativeConfig, chat, generate, generate_jit, stream_text
from fnx.model import Model, extend, forward, load, new_state

__version__ = "0.1.0"
__all__ = ["ConfigError", "Engine", "Model", "ModelConfig", "SamplingParams", "SpeculativeConfig", "chat", "extend",
           "forward", "generate", "generate_jit", "load", "new_state", "stream_text"]
