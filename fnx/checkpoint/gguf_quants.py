"""Vectorised NumPy dequantizers for the GGML block formats, written from the format definitions.

Each takes the packed blocks `uint8 [n_blocks, type_size]` and returns `float32 [n_blocks, block_size]`, doing the
fp32 products in the same order as ggml (so the results are bit-identical to the `gguf` package's reference).
The packed bytes stay available to callers (`dequantize` reads them, it does not own them), for kernels that work on
the blocks directly. Supported: `DEQUANTIZERS`; anything else raises with that list."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

QK_K = 256
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> fp32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return b & 0x0F, b >> 4


def _q8_0(b):
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b[:, :2])


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K / Q5_K -> 8 six-bit scales and 8 six-bit mins, [n, 8] each."""
    lo, mid, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return scale.astype(np.float32), mins.astype(np.float32)


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    lo, hi = _nibbles(b[:, 16:144].reshape(n, 4, 32))
    q = np.stack([lo, hi], axis=2).reshape(n, 8, 32).astype(np.float32)   # sub-block 2i: low, 2i+1: high
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).reshape(n, QK_K)


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]                                                          # [n, 32]
    lo, hi = _nibbles(b[:, 48:176].reshape(n, 4, 32))
    q = np.stack([lo, hi], axis=2).reshape(n, 8, 32)
    bit = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # sub-block j takes bit j
    q = (q | (bit << 4)).astype(np.float32)
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).reshape(n, QK_K)


def _q6_k(b):
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)                      # [n, 16]
    d = _f16(b[:, 208:210])
    lo, hi = _nibbles(ql)                                                     # [n, 2, 64] each
    low4 = np.concatenate([lo, hi], axis=2).reshape(n, 2, 4, 32)             # q1 q2 q3 q4 per half
    high2 = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    q = ((low4 | (high2 << 4)).astype(np.int8) - np.int8(32)).astype(np.float32).reshape(n, 16, 16)
    return ((d * sc)[..., None] * q).reshape(n, QK_K)


def _iq4_nl(b):
    n = b.shape[0]
    lo, hi = _nibbles(b[:, 2:18])
    idx = np.concatenate([lo, hi], axis=1)                                    # [n, 32]
    return _f16(b[:, 0:2]) * IQ4_VALUES[idx]


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    sh = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)                      # [n, 1]
    sl = b[:, 4:8]
    ib = np.arange(8)
    low = (sl[:, ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0x0F
    high = ((sh >> (2 * ib).astype(np.uint16)) & 3).astype(np.uint8)
    ls = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)  # [n, 8]
    lo, hi = _nibbles(b[:, 8:136].reshape(n, 8, 16))
    idx = np.concatenate([lo, hi], axis=2)                                    # [n, 8, 32]
    return ((d * ls)[..., None] * IQ4_VALUES[idx]).reshape(n, QK_K)


DEQUANTIZERS = {
    T.Q8_0: _q8_0,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
}
PLAIN = {T.F32: np.float32, T.F16: np.float16}


def supported() -> list[str]:
    return sorted([t.name for t in PLAIN] + ["BF16"] + [t.name for t in DEQUANTIZERS])


def dequantize(data: np.ndarray, qtype: T, shape: tuple[int, ...], chunk_blocks: int = 1 << 20) -> np.ndarray:
    """The packed bytes of one tensor (any array whose bytes are the blocks, row-major) -> fp32 `shape` (the
    torch-order shape, innermost dimension last). Works through the blocks in chunks to bound temporaries."""
    qtype = T(qtype)
    if qtype in PLAIN:
        return np.asarray(data).view(PLAIN[qtype]).reshape(shape).astype(np.float32)
    if qtype == T.BF16:
        u = np.asarray(data).view(np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    if qtype not in DEQUANTIZERS:
        raise ValueError(f"GGUF tensor type {qtype.name} is not supported; fnx dequantizes {supported()}")
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    n_values = int(np.prod(shape))
    if shape[-1] % block or raw.size != n_values // block * size:
        raise ValueError(f"{qtype.name} tensor of shape {shape}: {raw.size} bytes, expected "
                         f"{n_values // block * size} (rows must be a multiple of {block} values)")
    blocks = raw.reshape(-1, size)
    out = np.empty((blocks.shape[0], block), np.float32)
    fn = DEQUANTIZERS[qtype]
    for i in range(0, blocks.shape[0], chunk_blocks):
        out[i:i + chunk_blocks] = fn(blocks[i:i + chunk_blocks])
    return out.reshape(shape)
