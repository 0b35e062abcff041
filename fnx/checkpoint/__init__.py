"""Checkpoint readers. Names are translated into the internal param tree in one place per format."""

from fnx.checkpoint.hf import CheckpointError, load_hf
from fnx.checkpoint.safetensors_io import SafetensorsFile

__all__ = ["CheckpointError", "SafetensorsFile", "load_hf"]
