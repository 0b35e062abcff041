"""QSA sparse decode attention in Pallas (Triton lowering): flash-decoding over the selected-token axis.

Grid (B*L, Hkv, n_splits). Program (bl, g, c) owns query token bl's heads of KV group g (the group's G query
heads padded to a power of two >= 16, so both dots are MMA-shaped) and slots [c*iters*block_n, (c+1)*iters*block_n)
of that token's index list. Each inner step loads block_n indices, gathers those K and V rows straight from the
cache (rows with index -1 are masked: no memory traffic), and updates an online softmax. Each program writes
its partial max m, sum l and unnormalised accumulator acc; `combine` merges the splits in jnp (a few KB).
All G query heads of a KV head share one gather of K/V."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import dispatch, pdl
from fnx.pallas.dot_acc import dot_acc

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST   # fp32 operands: IEEE, not TF32; bf16 operands: no effect


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_n: int = 32        # selected tokens per inner step (power of two, >= 16)
    iters: int = 1           # inner steps per program
    n_splits: int = 64       # programs along the selected-token axis
    num_warps: int = 4
    num_stages: int = 2
    vfirst: int = 0          # 1: each step's V gather written before its K gather. In the stock sm_90 build with one
                             # step per program (iters 1: one token at B = 1) K's loads come first, then K's
                             # shared-memory store and barrier, and only then V's loads (8 of 30 loads after the
                             # first barrier: one more memory round trip per program); with V first none is late (0
                             # of 30) and the kernel takes 56 registers instead of 80. With iters > 1 the loop is
                             # pipelined (cp.async) and the order changes nothing. The same bits. Built 2026-12-05,
                             # not yet measured: FNX_QSA_TILES=vfirst=1
    ahead: int = 0           # 1: step i + 1's gathers and step i + 2's indices issued by hand before step i's
                             # arithmetic and carried in registers (`_kernel_ahead`), the kernel built with one stage
                             # (no Triton pipelining). The same bits. Built 2026-12-07; slower on an H100 (715b89e,
                             # B = 8 at 128K: T = 1 31.8 us against 29.7, T = 5 112.4 against 83.5), so off:
                             # FNX_QSA_TILES=ahead=1


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `choose_tiles` derives the tiles from. `FNX_QSA_TILES` ("field=value,...", read when a program is
    traced: a benchmark knob) replaces fields of the default."""
    programs: int = 264      # programs per launch to aim for (~2 per H200 SM): the splits are as many as fill it
    block_n: int = 0         # selected tokens per inner step; 0: 32 (16 below 32 selected tokens)
    num_warps: int = 4
    num_stages: int = 2
    vfirst: int = 0          # see Tiles.vfirst
    ahead: int = 0           # see Tiles.ahead


TILES_ENV = "FNX_QSA_TILES"


def parse_choice(spec: str, what: str) -> Choice:
    """The default `Choice` with the fields of `spec` ("field=value,...") over it; a bad spec raises, naming `what`
    (the knob it came from)."""
    c = Choice(**dispatch.fields_override(spec, Choice, what))
    if c.programs < 1 or c.num_warps < 1 or c.num_stages < 1 or c.vfirst not in (0, 1) or c.ahead not in (0, 1) or \
            (c.block_n and (c.block_n < 16 or c.block_n & (c.block_n - 1))):
        raise ValueError(f"{what}={spec!r}: programs, num_warps and num_stages >= 1, block_n 0 or a power of "
                         f"two >= 16, vfirst and ahead 0 or 1 (got {c})")
    return c


def env_choice() -> Choice:
    """`parse_choice` of `FNX_QSA_TILES` (the default when it is unset)."""
    return parse_choice(os.environ.get(TILES_ENV, "").strip(), TILES_ENV)


def choose_tiles(n_rows: int, hkv: int, n_sel: int, choice: Choice | None = None) -> Tiles:
    """Enough programs (`choice.programs`) that one sequence fills the GPU, the selected tokens split evenly over
    them in steps of block_n. n_rows = B * L query tokens; choice None: `env_choice()`."""
    c = env_choice() if choice is None else choice
    block_n = c.block_n or (32 if n_sel >= 32 else 16)
    chunks = -(-n_sel // block_n)
    want = max(1, -(-c.programs // (n_rows * hkv)))
    n_splits = min(chunks, want)
    iters = -(-chunks // n_splits)
    n_splits = -(-chunks // iters)
    return Tiles(block_n=block_n, iters=iters, n_splits=n_splits, num_warps=c.num_warps,
                 num_stages=1 if c.ahead else c.num_stages, vfirst=c.vfirst, ahead=c.ahead)


def _kernel(q_ref, idx_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *, length, hkv, seq_len, hd, block_n, iters,
            sm_scale, grp, gp, n_sel, vfirst=0, ahead=0):
    bl, g, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    base = (bl // length * hkv + g) * seq_len
    cols = jnp.arange(hd, dtype=jnp.int32)
    # the group's grp query heads as a [Gp, hd] tile, rows past grp repeating the last head (their outputs are
    # dropped): read in place from q [rows * Hkv * grp, hd], no padded copy of q before the launch
    heads = (bl * hkv + g) * grp + jnp.minimum(jnp.arange(gp, dtype=jnp.int32), grp - 1)
    q = q_ref[heads[:, None], jnp.broadcast_to(cols[None, :], (gp, hd))]
    sel = jnp.arange(block_n, dtype=jnp.int32)
    if ahead:
        return _kernel_ahead(q, idx_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, bl=bl, c=c, base=base, cols=cols,
                             sel=sel, block_n=block_n, iters=iters, sm_scale=sm_scale, gp=gp, n_sel=n_sel, hd=hd)

    def body(i, carry):
        m, l, acc = carry
        start = (c * iters + i) * block_n
        at = start + sel                  # the selection's tail past n_sel reads as -1 (no padded copy of idx)
        ix = idx_ref[jnp.full((block_n,), bl, jnp.int32), jnp.minimum(at, n_sel - 1)]      # [block_n]
        ix = jnp.where(at < n_sel, ix, -1)
        valid = ix >= 0
        rows = base + jnp.where(valid, ix, 0)
        at = (rows[:, None], cols[None, :])          # integer-array gather (the interpreter needs both arrays)
        kv_mask = jnp.broadcast_to(valid[:, None], (block_n, hd))
        if vfirst:                                                     # (see Tiles.vfirst)
            v = plt.load(v_ref.at[at], mask=kv_mask, other=0.0)
        k = plt.load(k_ref.at[at], mask=kv_mask, other=0.0)          # [block_n, hd]
        if not vfirst:
            v = plt.load(v_ref.at[at], mask=kv_mask, other=0.0)
        return _online_step(q, k, v, valid, m, l, acc, sm_scale)

    init = (jnp.full((gp,), -jnp.inf, F32), jnp.zeros((gp,), F32), jnp.zeros((gp, hd), F32))
    m, l, acc = jax.lax.fori_loop(0, iters, body, init)
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


def _online_step(q, k, v, valid, m, l, acc, sm_scale):
    """One step of the online softmax over block_n gathered tokens (k, v [block_n, hd], `valid` [block_n]): the
    running max m, sum l [Gp] and accumulator acc [Gp, hd] after it, with the model's roundings."""
    dt = q.dtype
    s = jnp.dot(q, k.T, precision=HIGHEST, preferred_element_type=F32)          # [Gp, block_n]
    s = (s.astype(dt).astype(F32) * sm_scale).astype(dt).astype(F32)
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_use)
    p = jnp.exp(s - m_use[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = dot_acc(acc * alpha[:, None], p.astype(dt), v.astype(dt))     # FNX_DOT_ACC: into the product
    return m_new, l, acc


def _kernel_ahead(q, idx_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *, bl, c, base, cols, sel, block_n, iters,
                  sm_scale, gp, n_sel, hd):
    """`_kernel`'s walk with its loads issued ahead by hand (`Tiles.ahead`): step i + 1's K / V gathers and step
    i + 2's indices are issued at the top of step i, before step i's arithmetic, and carried to the next step in
    registers, so a step waits on one memory round trip overlapped with the arithmetic before it instead of two
    after it. (The Triton pipeliner's schedule for `_kernel` at num_stages 2, read from its TTGIR: each step's
    arithmetic first, then a plain load of the next step's indices, then the next gathers, waited on at once by
    the next step.) Steps past the program's `iters` load nothing (their indices masked to -1). The same
    arithmetic in the same order as `_kernel`: the same bits."""

    def load_idx(i):
        at = (c * iters + i) * block_n + sel
        ok = (at < n_sel) & (i < iters)
        ix = plt.load(idx_ref.at[jnp.full((block_n,), bl, jnp.int32), jnp.minimum(at, n_sel - 1)], mask=ok,
                      other=-1)
        return jnp.where(ok, ix, -1)

    def load_kv(ix):
        valid = ix >= 0
        at = ((base + jnp.where(valid, ix, 0))[:, None], cols[None, :])
        kv_mask = jnp.broadcast_to(valid[:, None], (block_n, hd))
        return plt.load(k_ref.at[at], mask=kv_mask, other=0.0), plt.load(v_ref.at[at], mask=kv_mask, other=0.0)

    def body(i, carry):
        m, l, acc, ix, k, v, ix_next = carry
        k_next, v_next = load_kv(ix_next)                       # step i + 1's gathers (none past the last step)
        ix_after = load_idx(i + 2)
        return (*_online_step(q, k, v, ix >= 0, m, l, acc, sm_scale), ix_next, k_next, v_next, ix_after)

    ix0 = load_idx(0)
    k0, v0 = load_kv(ix0)
    init = (jnp.full((gp,), -jnp.inf, F32), jnp.zeros((gp,), F32), jnp.zeros((gp, hd), F32), ix0, k0, v0,
            load_idx(1))
    m, l, acc = jax.lax.fori_loop(0, iters, body, init)[:3]
    m_ref[...] = m
    l_ref[...] = l
    acc_ref[...] = acc


def combine(m: jax.Array, l: jax.Array, acc: jax.Array) -> jax.Array:
    """Merge the splits: m, l [..., n_splits, Gp], acc [..., n_splits, Gp, hd] -> o [..., Gp, hd] fp32."""
    mx = jnp.max(m, axis=-2, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(m - mx)                                               # 0 for empty splits
    den = jnp.sum(w * l, axis=-2)
    num = jnp.sum(w[..., None] * acc, axis=-3)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


@dataclasses.dataclass(frozen=True)
class CombineTiles:
    bd: int = 8             # head-dim columns per program (a power of two dividing hd): grid (rows, Hkv, hd / bd)
    splits: int = 16        # splits per step of a program's walk over the partials
    early: int = 1          # 1: every step's m and acc tiles and the gate loaded before any arithmetic. As written
                            # first the stock sm_90 build issued each step's acc tile after the previous step's
                            # sums and the gate after everything (one token, 8K: 47 of 79 loads after the first
                            # barrier, 236 registers at bd 16): a memory round trip per step on the critical path
                            # of 32 programs. With bd 8 the early tiles take half the registers. The same bits.
                            # bd 8 with early 1 is the default since measured: the one-token combine at 8K 3.42 us
                            # against 4.66 for bd 16 / early 0 (H100, 2026-12-07, the 4-layer step, two base runs);
                            # FNX_QSA_COMBINE_TILES=bd=16,early=0 gives the earlier tiles
    num_warps: int = 4


COMBINE_TILES_ENV = "FNX_QSA_COMBINE_TILES"


def combine_tiles() -> CombineTiles:
    """The combine's tiles; `FNX_QSA_COMBINE_TILES` ("field=value,...", read when a program is traced: a benchmark
    knob) replaces fields of the default."""
    spec = os.environ.get(COMBINE_TILES_ENV, "").strip()
    t = CombineTiles(**dispatch.fields_override(spec, CombineTiles, COMBINE_TILES_ENV)) if spec else CombineTiles()
    for name in ("bd", "splits"):
        v = getattr(t, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"{COMBINE_TILES_ENV}={spec!r}: {name} must be a power of two, got {v}")
    return t


def _combine_kernel(m_ref, l_ref, acc_ref, *rest, ns, gp, grp, hd, hkv, gated, gate_w, gate_start, out_dtype, bd,
                    splits, early):
    """Program (r, g, j): query token r's heads of KV group g, head-dim columns [j*bd, (j+1)*bd): `combine` over
    the ns splits' partials (m, l [rows*Hkv*ns, Gp], acc [rows*Hkv*ns, Gp, hd], flattened), rounded to out_dtype,
    times sigmoid(gate) rounded as the model's output gate when gated (the gate read in place in its product:
    row r's head h at column gate_start + h * 2hd + hd + c of a [rows, gate_w] buffer). early: see CombineTiles."""
    gate_ref = rest[0] if gated else None
    o_ref = rest[-1]
    r, g, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    base = (r * hkv + g) * ns
    # the Gp rows are the grp heads, the padding rows repeating the last head: they read its partials and gate and
    # store its value at its place (the same bits twice: no masked store, whose masked lanes the interpreter writes
    # back as they were, racing the real lane at the same address)
    heads = jnp.minimum(jnp.arange(gp, dtype=jnp.int32), grp - 1)
    cols = j * bd + jnp.arange(bd, dtype=jnp.int32)
    nsp = _pow2(ns)
    sp = jnp.arange(nsp, dtype=jnp.int32)
    at = (base + jnp.minimum(sp, ns - 1))[:, None] * gp + heads[None, :]                     # [nsp, Gp]
    sok = jnp.broadcast_to((sp < ns)[:, None], (nsp, gp))
    m = plt.load(m_ref.at[at], mask=sok, other=-jnp.inf)
    l_all = plt.load(l_ref.at[at], mask=sok, other=0.0)
    cs = min(splits, nsp)
    sc = None

    def step_rows(c0):
        """Step c0's splits c0 .. c0 + cs - 1: which exist, and their partials' rows."""
        ids = c0 + sc
        return ids < ns, base + jnp.minimum(ids, ns - 1)

    def load_m(ok, row):                                                                      # [cs, Gp]
        return plt.load(m_ref.at[row[:, None] * gp + heads[None, :]],
                        mask=jnp.broadcast_to(ok[:, None], (cs, gp)), other=-jnp.inf)

    def load_acc(ok, row):                                                                    # [cs, Gp, bd]
        return plt.load(acc_ref.at[(row[:, None, None] * gp + heads[None, :, None]) * hd + cols[None, None, :]],
                        mask=jnp.broadcast_to(ok[:, None, None], (cs, gp, bd)), other=0.0)

    def load_gate(head):
        return plt.load(gate_ref.at[r * gate_w + gate_start + head[:, None] * (2 * hd) + hd + cols[None, :]])

    # (with early 0 the ops come in the order of the first version: its Triton IR is unchanged)
    steps = range(0, ns, cs)
    tiles = gt = None
    if early:
        sc = jnp.arange(cs, dtype=jnp.int32)
        tiles = [(load_m(*rows), load_acc(*rows)) for rows in map(step_rows, steps)]
        gt = load_gate(g * grp + heads) if gated else None
    mx = jnp.max(m, axis=0)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)                                                # [Gp]
    den = jnp.sum(jnp.exp(m - mx[None, :]) * l_all, axis=0)                                  # 0 for empty splits
    num = jnp.zeros((gp, bd), F32)
    if not early:
        sc = jnp.arange(cs, dtype=jnp.int32)
    for i, c0 in enumerate(steps):                 # the splits in steps of cs: [cs, Gp, bd] tiles of acc
        rows = None if early else step_rows(c0)
        w = jnp.exp((tiles[i][0] if early else load_m(*rows)) - mx[None, :])
        a = tiles[i][1] if early else load_acc(*rows)
        num = num + jnp.sum(w[:, :, None] * a, axis=0)
    o = (num / jnp.where(den > 0, den, 1.0)[:, None]).astype(out_dtype)                       # [Gp, bd]
    hq = hkv * grp
    head = g * grp + heads
    if gated:
        gt = gt if early else load_gate(head)
        sg = jax.nn.sigmoid(gt.astype(F32)).astype(out_dtype).astype(F32)
        o = (o.astype(F32) * sg).astype(out_dtype)
    plt.store(o_ref.at[(r * hq + head[:, None]) * hd + cols[None, :]], o)


def combine_kernel(m, l, acc, grp: int, out_dtype, gate=None, *, interpret: bool = False,
                   tiles: CombineTiles | None = None):
    """`combine` in one launch: m, l [rows, Hkv, ns, Gp], acc [rows, Hkv, ns, Gp, hd] -> o [rows, Hkv*grp, hd] in
    out_dtype (the first grp of the Gp padded heads), and with gate = (buffer [rows, W], start) the model's output
    gate: round(o * round(sigmoid(gate))), the gate of head h at columns start + h*2hd + hd + [0, hd) of the buffer
    (the q_proj product holds each head's query then its gate)."""
    rows, hkv, ns, gp, hd = acc.shape
    t = tiles or combine_tiles()
    if hd % t.bd:
        raise ValueError(f"qsa combine: head_dim {hd} is not a multiple of bd {t.bd}")
    gated = gate is not None
    args = [m.reshape(-1), l.reshape(-1), acc.reshape(-1)]
    gate_w = gate_start = 0
    if gated:
        buf, gate_start = gate
        gate_w = buf.shape[-1]
        if buf.shape[0] != rows or gate_start + hkv * grp * 2 * hd > gate_w:
            raise ValueError(f"qsa combine: gate window at {gate_start} of {tuple(buf.shape)} does not hold "
                             f"{rows} rows of {hkv * grp} heads x (query, gate) of {hd}")
        args.append(buf.reshape(-1))
    whole = pl.BlockSpec(memory_space=pl.ANY)
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=t.num_warps, num_stages=1)}
    out = pdl.pallas_call(
        functools.partial(_combine_kernel, ns=ns, gp=gp, grp=grp, hd=hd, hkv=hkv, gated=gated, gate_w=gate_w,
                          gate_start=int(gate_start), out_dtype=out_dtype, bd=t.bd, splits=t.splits,
                          early=t.early),
        grid=(rows, hkv, hd // t.bd), in_specs=[whole] * len(args),
        out_specs=whole, out_shape=jax.ShapeDtypeStruct((rows * hkv * grp * hd,), out_dtype),
        interpret=interpret, name="qsa_combine", **params,
    )(*args)
    return out.reshape(rows, hkv * grp, hd)


def qsa_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, idx: jax.Array, *,
                         interpret: bool = False, tiles: Tiles | None = None, gate=None,
                         fused_combine: bool = False) -> jax.Array:
    """Same contract as reference.qsa_decode_attention. fused_combine: the splits merged by `combine_kernel` (one
    launch, not XLA's three reductions), and with gate = (buffer [B*L, W], start) the output gate applied there
    too (see combine_kernel); gate needs fused_combine."""
    bsz, length, hq, hd = q.shape
    hkv, hd_k = k_cache.shape[1], k_cache.shape[3]
    if hq % hkv or hd_k != hd or hd & (hd - 1) or hd < 16:
        raise ValueError(f"qsa_decode_attention: q {q.shape} and cache {k_cache.shape} need Hq % Hkv == 0, the same "
                         "head_dim, and a power-of-two head_dim >= 16")
    m, l, acc = qsa_decode_splits(q, k_cache, v_cache, idx, interpret=interpret, tiles=tiles)
    dt, grp = q.dtype, hq // hkv
    if fused_combine:
        return combine_kernel(m, l, acc, grp, dt, gate, interpret=interpret).reshape(bsz, length, hq, hd)
    if gate is not None:
        raise ValueError("qsa_decode_attention: the output gate rides on the fused combine (fused_combine=True)")
    o = combine(m, l, acc)[:, :, :grp]                                # [rows, Hkv, G, hd]
    return o.astype(dt).reshape(bsz, length, hq, hd)


def qsa_decode_splits(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, idx: jax.Array, *,
                      interpret: bool = False, tiles: Tiles | None = None):
    """The split kernel of `qsa_decode_attention` alone (one launch): its partials m, l [rows, Hkv, n_splits, Gp]
    and acc [rows, Hkv, n_splits, Gp, hd] (fp32), which `combine` / `combine_kernel` merge. Benchmarks time it
    apart from the merge."""
    bsz, length, hq, hd = q.shape
    _, hkv, seq_len, _ = k_cache.shape
    n_sel = idx.shape[-1]
    dt = q.dtype
    grp = hq // hkv
    gp = max(16, _pow2(grp))
    rows = bsz * length
    t = tiles or choose_tiles(rows, hkv, n_sel)
    qg = q.reshape(rows * hkv * grp, hd)
    ix = idx.reshape(rows, n_sel).astype(jnp.int32)
    kf = k_cache.astype(dt).reshape(bsz * hkv * seq_len, hd)
    vf = v_cache.astype(dt).reshape(bsz * hkv * seq_len, hd)

    kernel = functools.partial(_kernel, length=length, hkv=hkv, seq_len=seq_len, hd=hd, block_n=t.block_n,
                               iters=t.iters, sm_scale=hd ** -0.5, grp=grp, gp=gp, n_sel=n_sel, vfirst=t.vfirst,
                               ahead=t.ahead)
    grid = (rows, hkv, t.n_splits)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=t.num_warps, num_stages=1 if t.ahead else t.num_stages)
    m, l, acc = pdl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole, whole, whole, whole],
        out_specs=[pl.BlockSpec((None, None, None, gp), lambda i, j, c: (i, j, c, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, j, c: (i, j, c, 0)),
                   pl.BlockSpec((None, None, None, gp, hd), lambda i, j, c: (i, j, c, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((rows, hkv, t.n_splits, gp), F32),
                   jax.ShapeDtypeStruct((rows, hkv, t.n_splits, gp), F32),
                   jax.ShapeDtypeStruct((rows, hkv, t.n_splits, gp, hd), F32)],
        interpret=interpret,
        name="qsa_decode_attention",
        **params,
    )(qg, ix, kf, vf)
    return m, l, acc


def _scores_kernel(q_ref, pos_ref, blk_ref, out_ref, *, n_blocks, hi, di, bn, cr, sqrt_di):
    b, c = pl.program_id(0), pl.program_id(1)
    pos = pos_ref[...]                                                # [Lp]
    lp = pos.shape[0]
    rows = c * bn + jnp.arange(bn, dtype=jnp.int32)
    ok = rows < n_blocks
    at = ((b * n_blocks + jnp.where(ok, rows, 0))[:, None], jnp.arange(di, dtype=jnp.int32)[None, :])
    k = plt.load(blk_ref.at[at], mask=jnp.broadcast_to(ok[:, None], (bn, di)), other=0.0).astype(F32)   # [bn, di]
    acc = jnp.zeros((lp, bn), F32)
    for h in range(hi):
        acc = acc + jnp.maximum(jnp.dot(q_ref[h], k.T, precision=HIGHEST, preferred_element_type=F32), 0.0)
    s = acc / sqrt_di
    valid = (rows * cr + cr - 1)[None, :] <= pos[:, None]
    out_ref[...] = jnp.where(valid, s, -jnp.inf)


def qsa_index_scores(q_idx: jax.Array, blocks: jax.Array, positions: jax.Array, cr: int, *,
                     interpret: bool = False, bn: int = 128, num_warps: int = 4) -> jax.Array:
    """Same contract as reference.qsa_index_scores. Grid (B, ceil(NB / bn)): each program streams bn block keys
    once for every query row and indexer head of its sequence (rows padded to 16)."""
    bsz, length, hi, di = q_idx.shape
    n_blocks = blocks.shape[1]
    if di & (di - 1) or di < 16:
        raise ValueError(f"qsa_index_scores: indexer head_dim {di} must be a power of two >= 16")
    lp = max(16, _pow2(length))
    q = jnp.swapaxes(q_idx.astype(F32), 1, 2)                         # [B, Hi, L, di]
    q = jnp.pad(q, ((0, 0), (0, 0), (0, lp - length), (0, 0)))
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, lp - length)), constant_values=-1)
    n_prog = -(-n_blocks // bn)
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=num_warps, num_stages=2)
    out = pdl.pallas_call(
        functools.partial(_scores_kernel, n_blocks=n_blocks, hi=hi, di=di, bn=bn, cr=cr,
                          sqrt_di=float(np.sqrt(np.float32(di), dtype=np.float32))),
        grid=(bsz, n_prog),
        in_specs=[pl.BlockSpec((None, hi, lp, di), lambda b, c: (b, 0, 0, 0)),
                  pl.BlockSpec((None, lp), lambda b, c: (b, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, lp, bn), lambda b, c: (b, 0, c)),
        out_shape=jax.ShapeDtypeStruct((bsz, lp, n_prog * bn), F32),
        interpret=interpret, name="qsa_index_scores", **params,
    )(q, pos, blocks.reshape(bsz * n_blocks, di))
    return out[:, :length, :n_blocks]


# ---- the indexer's top-k block choice -------------------------------------------------------------------------------
#
# lax.top_k over a row of NB block scores runs as a full sort in XLA (one 20 us `sort` kernel per QSA layer and call
# at 8K context, 2,122 blocks). What the model needs from it is the set of k blocks. One program per query row
# holds the row's scores in registers as order-preserving int32 keys, finds the k-th largest key by building it bit
# by bit from the top (31 counts of key >= candidate), then takes every key above it and, among the keys equal to
# it, the lowest blocks first (the tie rule of lax.top_k), and writes their block numbers in ascending order.

TOPK_MAX_BLOCKS = 16384     # a row's scores stay in one program's registers (64K tokens of context at cr = 4)
TOPK_EARLY_ENV = "FNX_QSA_TOPK_EARLY"   # 1: the bit-by-bit search stops once exactly k keys are >= its prefix (read
                                        # when a program is traced; 0, the default: level in the 4-layer round on
                                        # an H100, 715b89e, 2026-12-07)


def topk_early() -> bool:
    """Whether the top-k kernel's search stops early (`FNX_QSA_TOPK_EARLY`): the k-th key's bits are built from the
    top while counting keys >= the prefix; once that count is exactly k, the keys >= the prefix are the row's k best
    (none below it can enter, none above it can leave), so the remaining bits change nothing. With distinct real
    scores that happens after ~15-23 of the 31 counts (a CPU simulation at 2,122-16,384 blocks, k = 512, relu-sum
    scores); ties at the boundary run all 31. Each count is a CTA-wide reduction, the kernel's critical path."""
    v = os.environ.get(TOPK_EARLY_ENV, "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{TOPK_EARLY_ENV}={v!r}: 1 (stop once exactly k keys are >= the prefix) or 0")
    return v == "1"


TOPK_SEARCH_ENV = "FNX_QSA_TOPK_SEARCH"     # how `top_set` finds the k-th key (read when a program is traced)
TOPK_SEARCHES = ("bits", "thirds", "radix2", "radix3", "radix4")
THIRDS_TRIPS = 20           # 3^20 > 2^31: the thirds search's counts after the sign's
THIRDS_MAX_LANES = 4096     # the default search is "thirds" for rows of at most this many lanes in a launch of
THIRDS_MAX_ROWS = 64        # at most this many rows (decode sizes), else "bits"


def topk_search(lanes: int, rows: int = 1) -> str:
    """How `top_set` finds the k-th largest key of a row of `lanes` keys in a launch over `rows` rows
    (`FNX_QSA_TOPK_SEARCH`; unset: "thirds" up to THIRDS_MAX_LANES lanes and THIRDS_MAX_ROWS rows, else "bits").
    Each CTA-wide count is a step of a row's critical path (a cross-warp exchange behind barriers), and each count's
    compares are the lanes a thread holds times the candidates; a launch over many rows (a prefill chunk's 2,048)
    is bound by its instructions rather than one row's chain:
    - "bits": the 31 bits below the sign one at a time, 31 counts of keys >= a candidate prefix.
    - "thirds": two candidates a count, both counts packed in one int32 reduction (16 bits each: rows of at most
      65,535 lanes), so the range the k-th key lies in shrinks to a third per count: 20 counts.
    - "radixR" (R = 2-4): R bits a count, one reduction of a [2^R, nbp] compare over its lanes (16, 11 and 8 counts;
      2^R times the compares and warp reductions of a one-bit count).
    Measured (H100, e9c0437, the 4-layer round at 8K, rows of 4,096 lanes): `qsa_select` 12.1-12.5 us a call with
    "bits", 11.7-12.0 with "thirds", 13.7-13.9 with "radix2". Rows longer than 4,096 lanes (past 16K context, and
    the segments past 64K) and launches over prefill chunks' rows ("thirds" does ~6% more instructions a row in
    the stock sm_90 build) are not measured with "thirds", so they keep "bits". Not with FNX_QSA_TOPK_EARLY=1
    (written for "bits")."""
    v = os.environ.get(TOPK_SEARCH_ENV, "").strip()
    if v and v not in TOPK_SEARCHES:
        raise ValueError(f"{TOPK_SEARCH_ENV}={v!r}: one of {', '.join(TOPK_SEARCHES)} (unset: thirds for rows of up "
                         f"to {THIRDS_MAX_LANES} lanes in launches of up to {THIRDS_MAX_ROWS} rows, else bits)")
    if topk_early():
        if v and v != "bits":
            raise ValueError(f"{TOPK_SEARCH_ENV}={v} and {TOPK_EARLY_ENV}=1: the early stop is written for the "
                             "one-bit search; set one of them")
        return "bits"
    return v or ("thirds" if lanes <= THIRDS_MAX_LANES and rows <= THIRDS_MAX_ROWS else "bits")


def _sortable(s):
    """fp32 -> int32 keys in the same order (-inf lowest). -0.0 sorts below +0.0 here and NaN is not ordered:
    the indexer scores are sums of relu terms (never -0.0) or -inf."""
    i = jax.lax.bitcast_convert_type(s, jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


LOWEST_KEY = -2 ** 31      # below every `_sortable` key (-inf's included): the padding lanes of a row


def top_set(key, k: int, early: bool = False, search: str | None = None):
    """The k largest of a row's int32 keys [nbp] (one program's registers), ties to the lowest lanes (lax.top_k's
    rule): (sel [nbp] bool, slot [nbp] int32: each chosen lane's place in ascending lane order). The k-th largest
    key is found from the top: its sign by one count of keys >= 0, then (`search` "bits") each lower bit kept where
    at least k keys stay >= the prefix, 31 CTA-wide counts, or in fewer counts of more candidates (`topk_search`);
    every key above it is chosen and, among the keys equal to it, the lowest lanes. early: see `topk_early` ("bits"
    only); search None: `topk_search`'s for this row's lanes (one row)."""
    nbp = key.shape[0]
    lowest = jnp.int32(LOWEST_KEY)
    if search is None:
        search = topk_search(nbp)
    if search not in TOPK_SEARCHES or (early and search != "bits"):
        raise ValueError(f"top_set: search {search!r} (one of {TOPK_SEARCHES}; the early stop with 'bits' only)")

    def count_ge(t):
        return jnp.sum(jnp.where(key >= t, 1, 0))

    n0 = count_ge(jnp.int32(0))
    kth = jnp.where(n0 >= k, jnp.int32(0), lowest)

    def bit(j, kth):
        cand = kth | jnp.left_shift(jnp.int32(1), 30 - j)
        return jnp.where(count_ge(cand) >= k, cand, kth)

    def digits(width: int):
        # the next `width` bits below those settled (bits [shift, shift + width) still 0 in kth): row d of the
        # count compares every key with the prefix kth | d << shift; the counts fall as d grows and row 0's is
        # >= k (kth's own), so the digit is the number of rows past row 0 that keep >= k keys
        d = jnp.arange(2 ** width, dtype=jnp.int32)

        def step(shift, kth):
            cand = kth | jnp.left_shift(d, shift)                                       # [2^width]
            n = jnp.sum(jnp.where(key[None, :] >= cand[:, None], 1, 0), axis=1)         # [2^width]
            return kth | jnp.left_shift(jnp.sum(jnp.where(n >= k, 1, 0)) - 1, shift)
        return step

    def third(_, c):
        # the k-th key is base + lo + [0, m] (offsets from the sign's base, m <= 2^31 - 1: no int32 overflows) and
        # at least k keys are >= base + lo; two candidates cut [lo, lo + m] in three (t = ceil((m + 1) / 3), the
        # candidates clamped into the range), their counts in one reduction, 16 bits each; the next range is the
        # part the k-th key lies in, m' <= m // 3
        base, lo, m = c
        t = m // 3 + 1
        c1, c2 = lo + jnp.minimum(t, m), lo + jnp.minimum(2 * t, m)
        packed = jnp.sum(jnp.where(key >= base + c1, 1, 0) + jnp.where(key >= base + c2, 1 << 16, 0))
        n1, n2 = packed & 0xFFFF, jnp.right_shift(packed, 16)
        return (base, jnp.where(n2 >= k, c2, jnp.where(n1 >= k, c1, lo)),
                jnp.where(n2 >= k, lo + m - c2, jnp.where(n1 >= k, c2 - 1 - c1, c1 - 1 - lo)))
    if early:       # carry count_ge(kth) too, and stop once it is exactly k (topk_early)
        def more(c):
            return (c[0] < 31) & (c[2] != k)

        def step(c):
            j, kth, n = c
            cand = kth | jnp.left_shift(jnp.int32(1), 30 - j)
            nc = count_ge(cand)
            return j + 1, jnp.where(nc >= k, cand, kth), jnp.where(nc >= k, nc, n)
        n_kth = jnp.where(n0 >= k, n0, nbp)          # every lane's key is >= lowest
        kth = jax.lax.while_loop(more, step, (jnp.int32(0), kth, n_kth))[1]
    elif search == "bits":
        kth = jax.lax.fori_loop(0, 31, bit, kth)
    elif search == "thirds":
        if nbp >= 1 << 16:
            raise ValueError(f"top_set: the 'thirds' search packs counts in 16 bits; {nbp} lanes")
        _, lo, _ = jax.lax.fori_loop(0, THIRDS_TRIPS, third, (kth, jnp.int32(0), jnp.int32(2 ** 31 - 1)))
        kth = kth + lo
    else:           # 31 = full * radix + rest bits below the sign, from the top
        radix = int(search[len("radix"):])
        full, rest = divmod(31, radix)
        step = digits(radix)
        kth = jax.lax.fori_loop(0, full, lambda j, kth: step(31 - radix * (j + 1), kth), kth)
        if rest:
            kth = digits(rest)(0, kth)
    above = key > kth
    tie = jnp.where(key == kth, 1, 0)
    need = k - jnp.sum(jnp.where(above, 1, 0))
    sel = above | ((tie > 0) & (jnp.cumsum(tie) - tie < need))       # ties: the lowest lanes first
    seli = jnp.where(sel, 1, 0)
    return sel, jnp.cumsum(seli) - seli                              # ascending lane order


def _topk_kernel(s_ref, *refs, nb: int, nbp: int, k: int, seg: int = 0, keys: bool = False, early: bool = False,
                 search: str | None = None):
    """One row (or one segment of a row) per program: the k largest keys, ties to the lowest positions, their
    positions in ascending order (a permutation of the row written to out, the chosen first).
    seg > 0 (a long row's first stage): program (r, p) takes columns [p seg, p seg + nb) of row r (fewer in the last
    segment) and also writes the chosen keys and their columns. keys (the second stage): s holds int32 keys and
    refs[0] the columns they stand for, which are written instead of positions. early, search: see `topk_early`,
    `topk_search`."""
    if keys:
        ids_ref, out_ref = refs
    elif seg:
        out_ref, kout_ref = refs
    else:
        (out_ref,) = refs
    r = pl.program_id(0)
    blk = jnp.arange(nbp, dtype=jnp.int32)
    if seg:                                                 # this segment's columns of the row
        c0 = pl.program_id(1) * seg
        width = s_ref.shape[1]
        ok = (blk < nb) & (c0 + blk < width)
        s = s_ref[jnp.full((nbp,), r, jnp.int32), jnp.minimum(c0 + blk, width - 1)]
    else:
        ok = blk < nb
        s = s_ref[jnp.full((nbp,), r, jnp.int32), jnp.minimum(blk, nb - 1)]            # the row, in place
    key = jnp.where(ok, s if keys else _sortable(s), LOWEST_KEY)    # padding below every score (never chosen first)
    sel, slot = top_set(key, k, early, search)
    # a permutation of the row: the chosen blocks to [0, k), the others after them (every lane writes a distinct
    # place, so no store is masked and no two lanes meet)
    place = jnp.where(sel, slot, k + blk - slot)
    if keys:
        ids = ids_ref[jnp.full((nbp,), r, jnp.int32), jnp.minimum(blk, nb - 1)]
        out_ref[r * nbp + place] = ids
    elif seg:
        at = (r * pl.num_programs(1) + pl.program_id(1)) * nbp + place
        out_ref[at] = c0 + blk
        kout_ref[at] = key
    else:
        out_ref[r * nbp + place] = blk


def qsa_block_topk(scores: jax.Array, k: int, *, interpret: bool = False, seg: int = TOPK_MAX_BLOCKS) -> jax.Array:
    """The k blocks of the largest scores per row, as lax.top_k picks them (among equal scores the lower blocks),
    in ascending block order: scores [..., NB] fp32 -> [..., k] int32. A row of NB <= seg blocks: one program in
    one launch. Longer rows (`long_rows`, two launches): the row in segments of `seg` blocks, each segment's k best
    (with their keys) by one program, then the k best of those P * k candidates per row. The union of the
    segments' choices holds the row's choice (a block among a row's k best is among its segment's k best under the
    same order: score, then lower block), and the candidates stay in ascending block order, so ties still go to
    the lower blocks."""
    *lead, nb = scores.shape
    if not 0 < k <= nb:
        raise ValueError(f"qsa_block_topk: k={k} must be in [1, NB={nb}]")
    if seg & (seg - 1) or not k <= seg <= TOPK_MAX_BLOCKS:
        raise ValueError(f"qsa_block_topk: seg={seg} must be a power of two in [k={k}, {TOPK_MAX_BLOCKS}]")
    rows = int(np.prod(lead)) if lead else 1
    s2 = scores.reshape(rows, nb).astype(F32)
    if nb <= seg:
        nbp = _pow2(nb)
        out = _topk_call(s2, rows, nb, nbp, k, interpret)
        return out.reshape(rows, nbp)[:, :k].reshape(*lead, k)
    n_seg = -(-nb // seg)
    if n_seg * k > TOPK_MAX_BLOCKS:
        raise ValueError(f"qsa_block_topk: NB={nb} in {n_seg} segments of {seg} gives {n_seg * k} candidates per row "
                         f"> {TOPK_MAX_BLOCKS}")
    ids, keys = _topk_call(s2, rows, seg, seg, k, interpret, n_seg=n_seg)
    cand = n_seg * k                                          # per row: each segment's k, in ascending block order
    ids = ids.reshape(rows, n_seg, seg)[:, :, :k].reshape(rows, cand)
    keys = keys.reshape(rows, n_seg, seg)[:, :, :k].reshape(rows, cand)
    cp = _pow2(cand)
    out = _topk_call(keys, rows, cand, cp, k, interpret, ids=ids)
    return out.reshape(rows, cp)[:, :k].reshape(*lead, k)


def long_rows(nb: int, k: int, seg: int = TOPK_MAX_BLOCKS) -> str | None:
    """None when `qsa_block_topk` serves rows of nb blocks in two launches (segments of `seg`), else why not."""
    n_seg = -(-nb // seg)
    if n_seg * k > TOPK_MAX_BLOCKS or k > seg:
        return f"{nb} blocks in {n_seg} segments of {seg}: {n_seg * k} candidates per row > {TOPK_MAX_BLOCKS}"
    return None


def _topk_call(s2, rows: int, nb: int, nbp: int, k: int, interpret: bool, n_seg: int = 0, ids=None):
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=8 if nbp >= 4096 else 4, num_stages=1)
    n = rows * max(n_seg, 1) * nbp
    kernel = functools.partial(_topk_kernel, nb=nb, nbp=nbp, k=k, seg=nbp if n_seg else 0, keys=ids is not None,
                               early=topk_early(), search=topk_search(nbp, rows))
    args = (s2,) if ids is None else (s2, ids)
    out_shape = jax.ShapeDtypeStruct((n,), jnp.int32)
    return pdl.pallas_call(
        kernel,
        grid=(rows, n_seg) if n_seg else (rows,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(args),
        out_specs=(pl.BlockSpec(memory_space=pl.ANY),) * 2 if n_seg else pl.BlockSpec(memory_space=pl.ANY),
        out_shape=(out_shape, out_shape) if n_seg else out_shape,
        interpret=interpret, name="qsa_block_topk_seg" if n_seg else "qsa_block_topk", **params,
    )(*args)
