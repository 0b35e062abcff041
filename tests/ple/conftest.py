import json
import struct

import ml_dtypes
import numpy as np
import pytest

from fnx.ple import NgramConstants

ST_NAMES = {np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.bfloat16): "BF16",
            np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}


def write_safetensors(path, tensors: dict, shuffle_seed=None):
    """A safetensors file written by hand (so FP8/BF16 NumPy arrays need no torch); tensor order can be shuffled."""
    names = list(tensors)
    if shuffle_seed is not None:
        np.random.default_rng(shuffle_seed).shuffle(names)
    header, blobs, pos = {}, [], 0
    for n in names:
        a = np.ascontiguousarray(tensors[n])
        header[n] = {"dtype": ST_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
        blobs.append(a.tobytes())
        pos += a.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"".join(blobs))


# A small hash layout: 4 heads (2 bigram + 2 trigram), rows padded to a multiple of 16.
CONSTS_ARGS = dict(vocab_size=1000, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=997, vocab_divisor=16,
                   seed=3, ple_layer_index=0, eos_token_id=7)
WIDTH = 24
PARTS = 4


@pytest.fixture(scope="session")
def consts():
    return NgramConstants.build(**CONSTS_ARGS)


def make_table(consts, dtype, seed=0):
    """(stored table [rows, WIDTH] in dtype, scale or None)."""
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal((consts.num_rows, WIDTH)).astype(np.float32)
    if dtype == "fp8":
        return (vals * 100).astype(ml_dtypes.float8_e4m3fn), np.array([0.0123], dtype=ml_dtypes.bfloat16)
    return vals.astype(ml_dtypes.bfloat16), None


def write_checkpoint_table(directory, consts, dtype, *, buffers=True, layer=1, files=2, seed=0, with_scale=True):
    """The table split into PARTS shards over `files` safetensors files, as a checkpoint would hold it."""
    table, scale = make_table(consts, dtype, seed)
    prefix = f"model.language_model.layers.{layer}.ple.ple_embedding."
    shards = np.array_split(table, PARTS)
    per_file = [dict() for _ in range(files)]
    for i, sh in enumerate(shards):
        per_file[i % files][f"{prefix}ngram_embedding.shard_{i}.weight"] = sh
    if scale is not None and with_scale:
        per_file[0][f"{prefix}ngram_embedding.weight_scale"] = scale
    if buffers:
        per_file[-1][f"{prefix}layer_multipliers"] = consts.multipliers
        per_file[-1][f"{prefix}ngram_heads_vocab_sizes"] = consts.head_vocab_sizes
        per_file[-1][f"{prefix}ngram_heads_offsets"] = consts.head_offsets
    directory.mkdir(parents=True, exist_ok=True)
    for k, t in enumerate(per_file):
        write_safetensors(directory / f"model-{k:05d}.safetensors", t, shuffle_seed=k)
    return table, scale


def reference_rows(table, scale, ids):
    """What transformers computes: rows.to(scale.dtype) * scale (FP8), cast to bf16, concatenated per head."""
    rows = table[np.asarray(ids).reshape(-1)]
    if scale is not None:
        rows = rows.astype(ml_dtypes.bfloat16).astype(scale.dtype) * scale.reshape(())
    rows = rows.astype(ml_dtypes.bfloat16)
    return rows.reshape(np.asarray(ids).shape[0], -1)
