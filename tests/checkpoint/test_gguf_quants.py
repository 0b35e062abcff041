"""fnx's GGML dequantizers are bit-identical to the `gguf` package's reference on random blocks."""

import time

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as ref

from fnx.checkpoint import gguf_quants

F16_FIELDS = {T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0],
              T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ3_XXS: [0], T.IQ1_S: [0], T.IQ1_M: [], T.IQ2_S: [0], T.IQ3_S: [0]}


def _blocks(qtype, n, rng):
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:   # finite scales spanning several binades, both signs
        d = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 2, n)).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n, 2)
    if qtype == T.IQ1_M:   # the fp16 scale lives in the top nibbles of the four scale words
        d = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 2, n)).astype(np.float16).view(np.uint16)
        sc = raw[:, 48:56].copy().view(np.uint16)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = sc.view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", sorted(gguf_quants.DEQUANTIZERS, key=int), ids=lambda t: t.name)
def test_bit_exact_against_gguf_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = _blocks(qtype, 64, rng)
    shape = (8, 8 * block)
    got = gguf_quants.dequantize(raw, qtype, shape, chunk_blocks=24)   # chunking crosses rows
    want = ref.dequantize(raw.reshape(8, -1), qtype)
    assert got.shape == want.shape == shape and np.isfinite(got).all()
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_plain_types_and_errors():
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_array_equal(gguf_quants.dequantize(x.astype(np.float16).view(np.uint8), T.F16, (3, 64)),
                                  x.astype(np.float16).astype(np.float32))
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(gguf_quants.dequantize(bf.view(np.uint8), T.BF16, (3, 64)),
                                  ref.dequantize(bf.view(np.uint8), T.BF16))
    with pytest.raises(ValueError, match=r"Q3_K is not supported; fnx dequantizes \[.*Q6_K"):
        gguf_quants.dequantize(np.zeros(110, np.uint8), T.Q3_K, (1, 256))
    with pytest.raises(ValueError, match="rows must be a multiple of 32"):
        gguf_quants.dequantize(np.zeros(34, np.uint8), T.Q8_0, (2, 16))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.IQ2_XXS])
def test_vectorised_speed(qtype):
    """4M values: well under a second here, so 100M values take seconds."""
    rng = np.random.default_rng(1)
    raw = _blocks(qtype, 16384, rng)
    t = time.perf_counter()
    gguf_quants.dequantize(raw, qtype, (16384, 256))
    dt = time.perf_counter() - t
    print(f"{qtype.name}: {16384 * 256 / dt / 1e6:.0f} M values/s")
    assert dt < 2.0
