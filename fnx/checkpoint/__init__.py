"""Checkpoint readers. Names are translated into the internal param tree in one place per format."""

from fnx.checkpoint.hf import CheckpointError, load_checkpoint, load_hf, plan_checkpoint
from fnx.checkpoint.ngram_table import NgramTableView
from fnx.checkpoint.place import Loaded
from fnx.checkpoint.safetensors_io import SafetensorsFile


def load_any(path, dtype=None, quant: str | None = None, progress: bool = False, ngram_table: str = "device",
             scan_layers: bool | None = None) -> Loaded:
    """A `.gguf` file and an HF directory are planned and streamed; an fnx-converted (orbax) directory is restored
    as saved. scan_layers: the params layout (`ModelConfig.scan_layers`, None: the config's)."""
    import jax.numpy as jnp
    from fnx.checkpoint.orbax_io import is_converted, restore
    if str(path).endswith(".gguf"):
        from fnx.checkpoint.gguf import load_gguf
        return load_gguf(path, dtype=dtype, quant=quant, progress=progress, ngram_table=ngram_table,
                         scan_layers=scan_layers)
    if is_converted(path):
        if ngram_table != "device":
            raise ValueError(f"{path} is an fnx-converted checkpoint; its n-gram table is part of the restored tree")
        if quant is not None:
            raise ValueError(f"{path} is an fnx-converted checkpoint; it is restored as converted, so quant="
                             f"{quant!r} cannot apply (convert again with --quant)")
        out = restore(path)
        if scan_layers is not None and bool(scan_layers) != out.cfg.scan_layers:
            raise ValueError(f"{path} is an fnx-converted checkpoint restored in its saved layout (scan_layers="
                             f"{out.cfg.scan_layers}); asked for scan_layers={bool(scan_layers)} (convert again, or "
                             "load the HF checkpoint)")
        if dtype is not None:
            have = out.params["embed_tokens"].dtype
            if jnp.dtype(dtype) != have:
                raise ValueError(f"{path} was converted with dtype {have}; asked for {jnp.dtype(dtype)}")
        return out
    return load_checkpoint(path, dtype=jnp.bfloat16 if dtype is None else dtype, quant=quant, progress=progress,
                           ngram_table=ngram_table, scan_layers=scan_layers)

__all__ = ["CheckpointError", "Loaded", "NgramTableView", "SafetensorsFile", "load_any", "load_checkpoint", "load_hf",
           "plan_checkpoint"]
