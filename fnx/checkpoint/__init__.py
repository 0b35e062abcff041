"""Checkpoint readers. Names are translated into the internal param tree in one place per format."""

from fnx.checkpoint.hf import CheckpointError, load_checkpoint, load_hf, plan_checkpoint
from fnx.checkpoint.ngram_table import NgramTableView
from fnx.checkpoint.place import Loaded
from fnx.checkpoint.safetensors_io import SafetensorsFile

__all__ = ["CheckpointError", "Loaded", "NgramTableView", "SafetensorsFile", "load_checkpoint", "load_hf",
           "plan_checkpoint"]
