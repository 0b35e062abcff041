"""The PLE n-gram ids computed on the device with 32-bit integers only (no x64), for programs that must not leave
the device between tokens (the jitted generate loop). Exact: 64-bit products are carried as (hi, lo) uint32
limbs and reduced modulo each head's prime with a shift-and-add mulmod. `fnx.ple.ngram_ids` (host, int64) is
the reference it is tested against."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

U32 = jnp.uint32
BITS = 31


@jax.tree_util.register_dataclass
@dataclass
class NgramDeviceTables:
    mult_hi: jax.Array      # [n] uint32
    mult_lo: jax.Array      # [n] uint32
    primes: jax.Array       # [H] uint32
    two32_bits: jax.Array   # [H, 31] uint32: bits of 2^32 mod prime, most significant first
    offsets: jax.Array      # [H] int32
    eos: jax.Array          # [] uint32

    @classmethod
    def build(cls, consts) -> "NgramDeviceTables":
        primes = np.asarray(consts.head_vocab_sizes, np.int64)
        if primes.max() >= 2**31 or consts.num_rows >= 2**31:
            raise ValueError("device n-gram ids need head vocab sizes and table rows below 2^31")
        mult = np.asarray(consts.multipliers, np.uint64)
        rem = (np.uint64(2**32) % primes.astype(np.uint64)).astype(np.int64)
        bits = np.array([[(int(r) >> (BITS - 1 - i)) & 1 for i in range(BITS)] for r in rem], np.uint32)
        return cls(jnp.asarray((mult >> np.uint64(32)).astype(np.uint32)),
                   jnp.asarray((mult & np.uint64(0xFFFFFFFF)).astype(np.uint32)),
                   jnp.asarray(primes.astype(np.uint32)), jnp.asarray(bits),
                   jnp.asarray(np.asarray(consts.head_offsets, np.int32)),
                   jnp.asarray(np.uint32(consts.eos_token_id)))


def _mul32(a, b):
    """a * b for uint32 arrays as (hi, lo) uint32 limbs."""
    m16 = U32(0xFFFF)
    a0, a1, b0, b1 = a & m16, a >> 16, b & m16, b >> 16
    p0, p1, p2, p3 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p0 >> 16) + (p1 & m16) + (p2 & m16)
    lo = (p0 & m16) | ((mid & m16) << 16)
    hi = p3 + (p1 >> 16) + (p2 >> 16) + (mid >> 16)
    return hi, lo


def _mulmod(x, bits, p):
    """x * c mod p, with c given by its bits (MSB first, last axis); x < p < 2^31."""
    acc = jnp.zeros_like(x)
    for i in range(BITS):
        acc = (acc * U32(2)) % p
        acc = jnp.where(bits[..., i] == 1, (acc + x) % p, acc)
    return acc


def ngram_ids_device(context: jax.Array, tokens: jax.Array, t: NgramDeviceTables) -> jax.Array:
    """context [B, n-1], tokens [B, L] (int32) -> ids [B, L, H] int32, equal to `fnx.ple.ngram_ids`."""
    n = t.mult_hi.shape[0]
    heads = t.primes.shape[0]
    per = heads // (n - 1)
    hist = jnp.concatenate([context, tokens], axis=1).astype(U32)              # [B, n-1+L]
    length = tokens.shape[1]
    cur = hist[:, n - 1:]
    blocked = jnp.zeros(cur.shape, bool)
    shifted = [cur]
    for s in range(1, n):
        prev = hist[:, n - 1 - s: n - 1 - s + length]
        blocked = blocked | (prev == t.eos)
        shifted.append(jnp.where(blocked, t.eos, prev))
    out = []
    mix_hi, mix_lo = None, None
    for j in range(n):
        hi, lo = _mul32(shifted[j], t.mult_lo[j])
        hi = hi + shifted[j] * t.mult_hi[j]
        mix_hi = hi if mix_hi is None else mix_hi ^ hi
        mix_lo = lo if mix_lo is None else mix_lo ^ lo
        if j >= 1:  # an (j+1)-gram: its heads
            sl = slice((j - 1) * per, j * per)
            p = t.primes[sl]
            h_mod = mix_hi[..., None] % p
            r = _mulmod(h_mod, t.two32_bits[sl], p)
            r = (r + mix_lo[..., None] % p) % p
            out.append(r.astype(jnp.int32) + t.offsets[sl])
    return jnp.concatenate(out, axis=-1)
