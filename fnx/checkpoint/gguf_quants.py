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


# ---- lattice ("IQ") formats. The lattice tables are format constants; they are taken from the `gguf` package's
# decoded grids rather than restated here.

def _grid(name: str) -> np.ndarray:
    import gguf.quants as gq
    cls = getattr(gq, name)
    cls.init_grid()
    return np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)


_GRIDS: dict = {}


def grid(name: str) -> np.ndarray:
    if name not in _GRIDS:
        _GRIDS[name] = _grid(name)
    return _GRIDS[name]


# 7 stored sign bits + an 8th that makes the number of negative signs even
_i = np.arange(128, dtype=np.uint8)
KSIGNS = _i | ((np.unpackbits(_i[:, None], axis=1).sum(1) & 1).astype(np.uint8) << 7)
_BITS8 = np.arange(8, dtype=np.uint8)


def _sign_bytes(bytes_: np.ndarray) -> np.ndarray:
    """uint8 sign masks [...] -> +-1 fp32 [..., 8] (bit j set: value j negative)."""
    return np.where((bytes_[..., None] >> _BITS8) & 1, np.float32(-1), np.float32(1))


def _iq2_xxs(b):
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    q = np.ascontiguousarray(b[:, 2:66]).view(np.uint32).reshape(n, 8, 2)        # per 32 values: idx, signs+scale
    db = (d * (np.float32(0.5) + (q[..., 1] >> 28).astype(np.float32)) * np.float32(0.25))[..., None, None]
    idx = q[..., 0:1].view(np.uint8).reshape(n, 8, 4)                             # 4 grid rows of 8
    sidx = (q[..., 1:2] >> np.array([0, 7, 14, 21], np.uint32)) & 127             # [n, 8, 4]
    return (db * grid("IQ2_XXS")[idx] * _sign_bytes(KSIGNS[sidx])).reshape(n, QK_K)


def _iq2_xs(b):
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    q = np.ascontiguousarray(b[:, 2:66]).view(np.uint16).reshape(n, 8, 4)        # 9-bit grid idx, 7-bit signs
    sc = b[:, 66:74]
    s = np.stack([sc & 0x0F, sc >> 4], axis=2).reshape(n, 16).astype(np.float32)  # one scale per 16 values
    db = (d * (np.float32(0.5) + s) * np.float32(0.25)).reshape(n, 8, 2, 1, 1)
    g = grid("IQ2_XS")[q & 511].reshape(n, 8, 2, 2, 8)
    sg = _sign_bytes(KSIGNS[q >> 9]).reshape(n, 8, 2, 2, 8)
    return (db * g * sg).reshape(n, QK_K)


def _iq3_xxs(b):
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    idx = b[:, 2:66].reshape(n, 8, 8)                                            # 8 grid rows of 4 per 32 values
    aux = np.ascontiguousarray(b[:, 66:98]).view(np.uint32).reshape(n, 8)
    db = (d * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5))[..., None, None]
    sidx = (aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127
    g = grid("IQ3_XXS")[idx].reshape(n, 8, 4, 8)
    return (db * g * _sign_bytes(KSIGNS[sidx])).reshape(n, QK_K)


def _bits(b: np.ndarray) -> np.ndarray:
    """uint8 [n, k] -> the k*8 bits, least significant first, [n, 8k]."""
    return ((b[..., None] >> _BITS8) & 1).reshape(b.shape[0], -1)


def _iq2_s(b):
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qs, signs, qh, sc = b[:, 2:34], b[:, 34:66], b[:, 66:74], b[:, 74:82]
    s = np.stack([sc & 0x0F, sc >> 4], axis=2).reshape(n, 16).astype(np.float32)
    db = (d * (np.float32(0.5) + s) * np.float32(0.25)).reshape(n, 16, 1, 1)
    hi = ((qh[..., None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(n, 32).astype(np.uint16)
    g = grid("IQ2_S")[qs.astype(np.uint16) | (hi << 8)].reshape(n, 16, 2, 8)
    sg = np.where(_bits(signs), np.float32(-1), np.float32(1)).reshape(n, 16, 2, 8)
    return (db * g * sg).reshape(n, QK_K)


def _iq3_s(b):
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qs, qh, signs, sc = b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:110]
    s = np.stack([sc & 0x0F, sc >> 4], axis=2).reshape(n, 8).astype(np.float32)
    db = (d * (np.float32(1) + np.float32(2) * s)).reshape(n, 8, 1, 1)
    g = grid("IQ3_S")[qs.astype(np.uint16) | (_bits(qh).astype(np.uint16) << 8)].reshape(n, 8, 4, 8)
    sg = np.where(_bits(signs), np.float32(-1), np.float32(1)).reshape(n, 8, 4, 8)
    return (db * g * sg).reshape(n, QK_K)


IQ1_DELTA = np.float32(0.125)


def _iq1_s(b):
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qs = b[:, 2:34].reshape(n, 8, 4).astype(np.uint16)
    qh = np.ascontiguousarray(b[:, 34:50]).view(np.uint16).reshape(n, 8)
    dl = (d * (2 * ((qh >> 12) & 7) + 1))[..., None, None]
    delta = np.where(qh & 0x8000, -IQ1_DELTA, IQ1_DELTA)[..., None, None]
    idx = qs | (((qh[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7) << 8)
    return (dl * (grid("IQ1_S")[idx] + delta)).reshape(n, QK_K)


def _iq1_m(b):
    n = b.shape[0]
    qs = b[:, 0:32].reshape(n, 16, 2).astype(np.uint16)                         # 16 groups of 16 values
    qh = b[:, 32:48].reshape(n, 16)                                               # one byte per 2 grid rows
    sc = np.ascontiguousarray(b[:, 48:56]).view(np.uint16).reshape(n, 4)
    # the fp16 super-block scale is spread over the top nibbles of the four scale words
    d = ((sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000))
    d = d.astype(np.uint16).view(np.float16).astype(np.float32)[:, None]
    s = ((sc[..., None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(n, 16)  # one 3-bit scale per 16 values
    dl = (d * (2 * s + 1)).reshape(n, 8, 2, 1, 1)
    hi = np.stack([qh & 0x0F, qh >> 4], axis=2)                                  # [n, 16, 2]: 3 index bits + sign
    idx = qs | ((hi & 7).astype(np.uint16) << 8)
    delta = np.where(hi & 8, -IQ1_DELTA, IQ1_DELTA).reshape(n, 8, 2, 2, 1)
    g = grid("IQ1_S")[idx].reshape(n, 8, 2, 2, 8)
    return (dl * (g + delta)).reshape(n, QK_K)


DEQUANTIZERS = {
    T.Q8_0: _q8_0,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
    T.IQ2_XXS: _iq2_xxs,
    T.IQ2_XS: _iq2_xs,
    T.IQ3_XXS: _iq3_xxs,
    T.IQ1_S: _iq1_s,
    T.IQ1_M: _iq1_m,
    T.IQ2_S: _iq2_s,
    T.IQ3_S: _iq3_s,
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
