"""The QSA layer's masked attention for prefill-sized calls in one launch (op "qsa_prefill_attention").

The reference (`fnx.model.qsa`: the whole key axis, or `_masked_attention_chunked` past a 2,048-token capacity)
materializes fp32 scores [B, Hkv, G, L, T] (or a key chunk of them), transposes them, takes the softmax in passes
and multiplies by V: an H100 prefill table (2,048-token chunk, 10,304-token capacity) spent 2.6-3.0 ms of kernels on
one layer's attention, where the products are ~50 GFLOP. Here each program holds a tile of BQ queries of one query
head, walks the key tiles up to the tile's last position (the mask's causal bound: no tile past it is read), and
keeps a running max, sum and fp32 accumulator (online softmax): s = round(round(q k^T) * hd^-0.5) as the model
rounds, the token mask [B, L, T] applied, p = exp(s - max) rounded to the activation dtype for the P V product on
the tensor cores, o = acc / sum rounded once. The reference rounds p / sum instead of p (its probabilities), so the
bits differ: within a bf16 rounding of the output (tests). Query head h reads KV head h // G; a program may hold
`heads` query heads of one KV head (PrefillTiles.heads: their rows side by side, each K / V tile read once for
them), else the G heads of a group read the same tiles in separate programs (from L2 after the first).

Shapes: q [B, L, Hkv, G, hd], k / v [B, Hkv, T, hd] (the QSA state), mask [B, L, T] bool, positions [B, L]. hd a
power of two >= 16; T a multiple of BK (the served capacities are multiples of 256); any L (rows past it masked)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import dispatch, pdl
from fnx.pallas.dot_acc import dot_acc

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
TILES_ENV = "FNX_QSA_PREFILL_TILES"


@dataclasses.dataclass(frozen=True)
class PrefillTiles:
    bq: int = 64            # queries per program (bq x heads rows: a power of two >= 16, the MMA's M)
    bk: int = 32            # keys per step (a power of two >= 16 dividing the capacity)
    heads: int = 1          # query heads of one KV head per program (a power of two dividing G): each K / V tile
                            # is read once for all of them (their rows share the query's mask row)
    num_warps: int = 8
    num_stages: int = 3     # bk 32 at 3 stages (H100, 715b89e, 2026-12-07): at 2 stages the stock sm_90 build
                            # waits for a step's copies right after issuing them (`sass_count.py` "NO OVERLAP"); 3 fit
                            # the shared memory at bk 32. The 4-layer 2,048-token chunk at 8K 11,921.8 -> 11,860.3
                            # us, the 24-layer 8K prefill's QSA family 18.63 -> 17.23 ms (with the other two
                            # prefill defaults of that session); before: bk 64, 2 stages


HEADS_DEFAULT = 2   # two query heads of a KV head per program where they divide the group: H100 (cc01f54, a 2,048-token
                    # chunk) 1,254 us against 2,378 at 8K context (a 6,144-token prefix), 349 against 494 at 32K (none);
                    # heads 4 with bq 16 level with 1; bk 128 and 3 stages do not fit the shared memory

def choose_tiles(grp: int | None = None) -> PrefillTiles:
    """The defaults for `grp` query heads per KV head (None: unknown; heads=HEADS_DEFAULT where it divides grp, else
    1); `FNX_QSA_PREFILL_TILES` ("field=value,...", read when a program is traced) replaces fields."""
    t = PrefillTiles(heads=HEADS_DEFAULT if grp is None or grp % HEADS_DEFAULT == 0 else 1)
    spec = os.environ.get(TILES_ENV, "").strip()
    if spec:
        t = dataclasses.replace(t, **dispatch.fields_override(spec, PrefillTiles, TILES_ENV))
    return t


def why_not(hd: int, capacity: int, t: PrefillTiles, grp: int | None = None) -> str | None:
    """None when the kernel takes head dim hd over a cache of `capacity` tokens in tiles t (grp query heads per KV
    head, where known), else why not."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    if not pow2(hd):
        return f"head dim {hd}: a power of two >= 16"
    if not pow2(t.bq * t.heads) or not pow2(t.bk) or t.heads < 1 or t.heads & (t.heads - 1):
        return f"tiles bq={t.bq} x heads={t.heads}, bk={t.bk}: powers of two, bq x heads and bk >= 16"
    if capacity % t.bk:
        return f"KV capacity {capacity} is not a multiple of bk={t.bk}"
    if grp is not None and grp % t.heads:
        return f"heads={t.heads} does not divide the {grp} query heads of a KV head"
    return None


def _kernel(q_ref, k_ref, v_ref, m_ref, n_ref, o_ref, *, L, T, hkv, grp, hd, bq, bk, heads, factor, n_qt):
    dt = q_ref.dtype
    ph, pq = pl.program_id(0), pl.program_id(1)
    per_b = hkv * (grp // heads)
    b, hs = ph // per_b, ph % per_b                       # hs: a set of `heads` query heads of one KV head
    kv = hs // (grp // heads)
    r = jnp.arange(bq * heads, dtype=jnp.int32)
    rows = pq * bq + r // heads                           # each row's query (its heads next to each other)
    hg = hs * heads + r % heads                           # and query head (in Hkv * G)
    rok = rows < L
    col = jnp.arange(hd, dtype=jnp.int32)
    kk = jnp.arange(bk, dtype=jnp.int32)
    # q [B, L, Hkv * G, hd]; k, v [B, Hkv, T, hd]; mask [B, L, T] (int8); o as q
    qrow = (b * L + rows) * (hkv * grp) + hg
    q = plt.load(q_ref.at[qrow[:, None] * hd + col[None, :]], mask=rok[:, None], other=0.0)
    n_kt = plt.load(n_ref.at[b * n_qt + pq])         # key tiles up to the tile's last position

    def step(j, carry):
        m_i, l_i, acc = carry
        keys = j * bk + kk
        kt = plt.load(k_ref.at[((b * hkv + kv) * T + keys)[:, None] * hd + col[None, :]])            # [bk, hd]
        s = jnp.dot(q, kt.T, precision=HIGHEST, preferred_element_type=F32).astype(dt)               # [bq, bk]
        s = (s.astype(F32) * factor).astype(dt).astype(F32)
        see = plt.load(m_ref.at[(b * L + rows)[:, None] * T + keys[None, :]], mask=rok[:, None], other=0) != 0
        s = jnp.where(see, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        at = jnp.where(m_new == -jnp.inf, 0.0, m_new)    # no key seen yet: its terms exp(-inf) = 0
        alpha = jnp.exp(m_i - at)
        p = jnp.exp(s - at[:, None])
        vt = plt.load(v_ref.at[((b * hkv + kv) * T + keys)[:, None] * hd + col[None, :]])            # [bk, hd]
        acc = dot_acc(acc * alpha[:, None], p.astype(dt), vt)        # FNX_DOT_ACC: into the product
        return m_new, l_i * alpha + jnp.sum(p, axis=1), acc
    n = bq * heads
    init = (jnp.full((n,), -jnp.inf, F32), jnp.zeros((n,), F32), jnp.zeros((n, hd), F32))
    _, l_i, acc = lax.fori_loop(0, n_kt, step, init)
    o = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
    plt.store(o_ref.at[qrow[:, None] * hd + col[None, :]], o.astype(dt), mask=rok[:, None])


def qsa_prefill_attention(qh: jax.Array, kc: jax.Array, vc: jax.Array, mask: jax.Array, positions: jax.Array, *,
                          interpret: bool = False, tiles: PrefillTiles | None = None) -> jax.Array:
    """softmax(round(q k^T) * hd^-0.5, masked) V for every query over the keys `mask` [B, L, T] lets it see (see the
    module's note). qh [B, L, Hkv, G, hd]; kc, vc [B, Hkv, T, hd]; positions [B, L] (the key tiles a query tile
    walks end at its last position's). Returns o [B, L, Hkv, G, hd] in qh.dtype."""
    bsz, length, hkv, grp, hd = qh.shape
    cap = kc.shape[2]
    t = tiles or choose_tiles(grp)
    why = why_not(hd, cap, t, grp)
    if why:
        raise ValueError(f"qsa_prefill_attention: {why}")
    if kc.shape != (bsz, hkv, cap, hd) or vc.shape != kc.shape or mask.shape != (bsz, length, cap):
        raise ValueError(f"qsa_prefill_attention: q {qh.shape}, k {kc.shape}, v {vc.shape}, mask {mask.shape} "
                         "do not agree")
    dt = qh.dtype
    n_qt = -(-length // t.bq)
    pad = n_qt * t.bq - length
    last = jnp.pad(positions, ((0, 0), (0, pad)), mode="edge").reshape(bsz, n_qt, t.bq).max(axis=-1)
    n_kt = jnp.clip(last // t.bk + 1, 0, cap // t.bk).astype(jnp.int32).reshape(-1)
    flat = lambda a: a.reshape(-1)  # noqa: E731
    args = (flat(qh), flat(kc.astype(dt)), flat(vc.astype(dt)), flat(mask.astype(jnp.int8)), n_kt)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=t.num_warps,
                                                                         num_stages=t.num_stages)}
    body = functools.partial(_kernel, L=length, T=cap, hkv=hkv, grp=grp, hd=hd, bq=t.bq, bk=t.bk, heads=t.heads,
                             factor=float(hd ** -0.5), n_qt=n_qt)
    o = pdl.pallas_call(body, grid=(bsz * hkv * (grp // t.heads), n_qt), in_specs=[whole] * len(args), out_specs=whole,
                       out_shape=jax.ShapeDtypeStruct((bsz * length * hkv * grp * hd,), dt), interpret=interpret,
                       name="qsa_prefill_attention", **params)(*args)
    return o.reshape(bsz, length, hkv, grp, hd)
