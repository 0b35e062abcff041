"""Gated delta rule for few tokens (decode T = 1, MTP verify T = k+1) in Pallas with the Triton lowering.

Grid (B, HV, dv / BV): each program keeps its fp32 state slice S [dk, BV] in registers, runs the T tokens of the
call in order (unrolled up to `unroll`, a fori_loop past it) and writes o [B, T, HV, dv], the final state and,
with keep_steps, the state after every token. One read and one write of the state per call, whatever T is."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fnx.pallas.gdn.reference import L2NORM_EPS, rms_norm_gated, softplus
from fnx.pallas import pdl, stacked
from fnx.pallas.kernel_math import Partials, rnd, take_window, window_operand

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_v: int = 32       # BV: columns of the [dk, dv] state per program (a power of two dividing dv)
    num_warps: int = 4
    num_stages: int = 1
    unroll: int = 8         # T up to this is unrolled in the kernel; longer calls loop
    fuse_norm: bool = False  # with a norm: apply it in-kernel (needs block_v = dv), else after the kernel in jnp


def default_tiles(batch: int, hv: int, dv: int, norm: bool = False) -> Tiles:
    """Untuned heuristic. BV = 32 until the grid has two waves of 132 SMs at BV = 64 (B*HV >= 264 at dv = 128).
    A gated norm is fused (one whole head per program, 8 warps) once B*HV fills one wave (B >= 3 at HV = 48)."""
    if norm and batch * hv >= 132:
        return Tiles(block_v=dv, num_warps=8, fuse_norm=True)
    bv = 64 if batch * hv * (dv // 64) >= 2 * 132 else 32
    return Tiles(block_v=min(bv, dv))


def _gated_norm(o, z, w, eps, act, dt):
    """`fnx.model.ops.rms_norm_gated` on one head's [dv] fp32 output, rounding to dt where it rounds."""
    x = o.astype(dt).astype(F32)
    h = (x * lax.rsqrt(jnp.mean(x * x) + eps)).astype(dt).astype(F32)
    h = (w.astype(dt).astype(F32) * h).astype(dt).astype(F32)
    z = z.astype(F32)
    gate = jax.nn.sigmoid(z) if act == "sigmoid" else z * jax.nn.sigmoid(z)
    return (h * gate).astype(dt)


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, *refs, length, keep_steps, with_initial, qk_l2norm,
            scale, unroll, norm, masked, want_o=True, conv=None):
    if norm is not None:
        z_ref, w_ref, refs = refs[0], refs[1], refs[2:]
    nk = None
    if masked:                                              # tokens t >= n_keep[b]: g = 0, beta = 0 (no-ops)
        nk, refs = refs[0][0], refs[1:]
    cx_ref = None
    if conv is not None:                                    # the conv window's rows after n_keep (`_copy_conv`)
        cx_ref, refs = refs[0], refs[1:]
    if not want_o:                                          # the state alone: no q . S reduction, no o store
        refs = (None,) + tuple(refs)
    o_ref, sout_ref = refs[0], refs[1]
    steps_ref = refs[2] if keep_steps else None
    if cx_ref is not None:
        _copy_conv(cx_ref, refs[-1], nk, conv)
    off = 1 if with_initial else 0
    s = s_ref[0, 0, :, :]                                   # [dk, BV] fp32
    if keep_steps and with_initial:
        steps_ref[0, 0, 0, :, :] = s

    def step(t, s):
        qt = q_ref[0, t, 0, :].astype(F32)                  # [dk]
        kt = k_ref[0, t, 0, :].astype(F32)
        vt = v_ref[0, t, 0, :].astype(F32)                  # [BV]
        gt = g_ref[0, t, 0].astype(F32)
        bt = b_ref[0, t, 0].astype(F32)
        if nk is not None:
            gt = jnp.where(t < nk, gt, 0.0)
            bt = jnp.where(t < nk, bt, 0.0)
        if qk_l2norm:
            qt = qt * lax.rsqrt(jnp.sum(qt * qt) + L2NORM_EPS)
            kt = kt * lax.rsqrt(jnp.sum(kt * kt) + L2NORM_EPS)
        if scale is not None:
            qt = qt * scale
        s = s * jnp.exp(gt)
        kv = jnp.sum(s * kt[:, None], axis=0)               # [BV]
        delta = (vt - kv) * bt
        s = s + kt[:, None] * delta[None, :]
        if want_o:
            o = jnp.sum(s * qt[:, None], axis=0)            # [BV]
            if norm is not None:                            # BV = dv: the whole head is here
                o = _gated_norm(o, z_ref[0, t, 0, :], w_ref[:], norm[0], norm[1], o_ref.dtype)
            o_ref[0, t, 0, :] = o.astype(o_ref.dtype)
        if keep_steps:
            steps_ref[0, t + off, 0, :, :] = s
        return s

    if length <= unroll:
        for t in range(length):
            s = step(t, s)
    else:
        s = lax.fori_loop(0, length, step, s)
    sout_ref[0, 0, :, :] = s


def _copy_conv(cx_ref, out_ref, nk, conv):
    """Rollback's conv state, copied by the replay's programs: rows [n_keep, n_keep + W) of the window's conv input
    conv_x [B, W + T, C] (flat refs) into the state [B, W, C]. Program (b, h, j) of the grid (B, HV, dv / BV) copies
    columns [p CW, (p + 1) CW) of each row, p = h * (dv / BV) + j (the columns past C masked)."""
    width, span, chans, cw = conv
    b = pl.program_id(0)
    p = pl.program_id(1) * pl.num_programs(2) + pl.program_id(2)
    cols = p * cw + jnp.arange(cw, dtype=jnp.int32)
    ok = cols < chans
    for r in range(width):
        src = (b * span + nk + r) * chans + cols
        row = pltriton.load(cx_ref.at[src], mask=ok, other=0.0)
        pltriton.store(out_ref.at[(b * width + r) * chans + cols], row, mask=ok)


def gdn_recurrent(q, k, v, g, beta, state, keep_steps: bool = False, *, scale: float | None = None,
                  qk_l2norm: bool = False, steps_with_initial: bool = False, out_dtype=F32, inplace: bool = False,
                  tiles: Tiles | None = None, interpret: bool = False, norm=None, n_keep=None,
                  want_o: bool = True, conv=None):
    """See `fnx.pallas.gdn.api.gdn_recurrent`; shapes are checked there. norm: None or (z [B, T, HV, dv],
    weight [dv], eps, act): the gated RMSNorm on o, in-kernel when tiles.fuse_norm (needs BV = dv). n_keep: None
    or [B] int32: tokens t >= n_keep[b] made no-ops in the kernel. want_o False: o is neither computed nor
    written (None is returned in its place). conv: None or (conv_x [B, W + T, C], W) with n_keep: the programs also
    copy rows [n_keep, n_keep + W) of conv_x (the conv state after the kept tokens), returned last [B, W, C]."""
    if not want_o and norm is not None:
        raise ValueError("gdn_recurrent: a gated norm applies to o, which want_o=False does not compute")
    if conv is not None and (n_keep is None or keep_steps):
        raise ValueError("gdn_recurrent: the conv copy is the rollback replay's (n_keep given, no per-step states)")
    bsz, length, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    rep = hv // hk
    t = tiles or default_tiles(bsz, hv, dv, norm is not None)
    if norm is not None and not t.fuse_norm:                # the kernel, then the norm as XLA ops
        res = gdn_recurrent(q, k, v, g, beta, state, keep_steps, scale=scale, qk_l2norm=qk_l2norm,
                            steps_with_initial=steps_with_initial, out_dtype=out_dtype, inplace=inplace, tiles=t,
                            interpret=interpret, n_keep=n_keep)       # want_o: the norm needs o
        return (rms_norm_gated(res[0], *norm),) + res[1:]
    if norm is not None and t.block_v != dv:
        raise ValueError(f"the fused gated norm needs block_v = dv = {dv}, got {t.block_v}")
    bv = t.block_v
    grid = (bsz, hv, dv // bv)
    n_steps = length + (1 if steps_with_initial else 0)
    qk_spec = pl.BlockSpec((1, length, 1, dk), lambda b, h, j: (b, 0, h // rep, 0))
    gb_spec = pl.BlockSpec((1, length, 1), lambda b, h, j: (b, 0, h))
    state_spec = pl.BlockSpec((1, 1, dk, bv), lambda b, h, j: (b, h, 0, j))
    in_specs = [qk_spec, qk_spec, pl.BlockSpec((1, length, 1, bv), lambda b, h, j: (b, 0, h, j)),
                gb_spec, gb_spec, state_spec]
    out_specs = [pl.BlockSpec((1, length, 1, bv), lambda b, h, j: (b, 0, h, j)), state_spec]
    out_shape = [jax.ShapeDtypeStruct((bsz, length, hv, dv), out_dtype),
                 jax.ShapeDtypeStruct((bsz, hv, dk, dv), F32)]
    if not want_o:
        out_specs, out_shape = out_specs[1:], out_shape[1:]
    if keep_steps:
        out_specs.append(pl.BlockSpec((1, n_steps, 1, dk, bv), lambda b, h, j: (b, 0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((bsz, n_steps, hv, dk, dv), F32))
    operands = [q, k, v, g, beta, state]
    if norm is not None:
        in_specs += [pl.BlockSpec((1, length, 1, dv), lambda b, h, j: (b, 0, h, 0)),
                     pl.BlockSpec((dv,), lambda b, h, j: (0,))]
        operands += [norm[0], norm[1]]
    if n_keep is not None:
        in_specs.append(pl.BlockSpec((1,), lambda b, h, j: (b,)))
        operands.append(n_keep.astype(jnp.int32))
    conv_meta = None
    if conv is not None:
        conv_x, width = conv
        cb, span, chans = conv_x.shape
        if cb != bsz or span != width + length:
            raise ValueError(f"gdn_recurrent: conv_x {tuple(conv_x.shape)} must be [B={bsz}, W + T={width + length}, "
                             "C]")
        programs = hv * (dv // bv)
        cw = max(16, 1 << (-(-chans // programs) - 1).bit_length())     # columns per program, a power of two
        conv_meta = (width, span, chans, cw)
        in_specs.append(pl.BlockSpec((conv_x.size,), lambda b, h, j: (0,)))
        operands.append(conv_x.reshape(-1))
        out_specs.append(pl.BlockSpec((bsz * width * chans,), lambda b, h, j: (0,)))
        out_shape.append(jax.ShapeDtypeStruct((bsz * width * chans,), conv_x.dtype))
    kernel = functools.partial(_kernel, length=length, keep_steps=keep_steps, with_initial=steps_with_initial,
                               qk_l2norm=qk_l2norm, scale=scale, unroll=t.unroll,
                               norm=None if norm is None else (float(norm[2]), norm[3]), masked=n_keep is not None,
                               want_o=want_o, conv=conv_meta)
    res = stacked.call(     # the norm weight may be a layer of a stack (fnx.pallas.stacked): read in place
        kernel, operands, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=({5: 1 if want_o else 0} if inplace else {}),
        compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret, name="gdn_recurrent",
    )
    res = list(res)
    if conv is not None:
        res[-1] = res[-1].reshape(bsz, conv[1], -1)
    return tuple(res) if want_o else (None,) + tuple(res)


# ---------------------------------------------------------------------------------------------------------------
# gdn_step: one decode token of a GDN layer's core in one kernel (conv update + silu, gates, recurrence, norm).
# Grid (B, HV, dv / BV): program (b, h, j) owns columns [j BV, (j+1) BV) of value head h's [dk, dv] state. It
# recomputes the conv of the q / k channels of its key head (the programs of a key head group share them:
# 2 x dk x K multiply-adds, nothing next to the state), convolves its own BV v channels and writes their new conv
# window; program j = 0 of the first value head of each key head group also writes the q / k channels' window.
# Every window element is written by exactly one program, so the new conv state needs no copy of the old one (and
# must not alias it: other programs still read the q / k rows). With BV = dv the gated norm runs in the kernel;
# with BV < dv (more programs, for small batches) o leaves the kernel raw and the norm runs after it in XLA.


@dataclasses.dataclass(frozen=True)
class StepTiles:
    block_v: int = 128      # BV (a power of two dividing dv); BV = dv fuses the gated norm
    num_warps: int = 4
    early: int = 0          # 1 = every operand but the state (the conv window rows, qkv, the conv weights, b, a,
                            # A_log, dt_bias, z, the norm's weight) loaded before any arithmetic. As written first,
                            # the stock sm_90 build issued the q and k conv inputs each after a barrier of the
                            # previous conv, b / a / A_log / dt_bias after the window stores and z and the norm's
                            # weight after the recurrence: memory round trips in a row on each program's critical
                            # path (48 programs at B = 1). The same bits. Built 2026-12-05, not yet measured:
                            # FNX_GDN_STEP_TILES=early=1
    cinplace: int = 0       # 1 = the conv window updated in place (its output aliases conv_state): each program
                            # writes its own v channels' rows; a key head's q / k rows, which all of its HV/HK x
                            # dv/BV programs read, are written by the last of them to arrive at a per-head counter
                            # (acquire-release atomic after a CTA barrier, `fnx.pallas.grid_sync`; the program's
                            # counters from the decode program's pool, else a fresh buffer). Default 0: the window
                            # goes to a new buffer, which XLA then copies into the donated state (one memcpy kernel
                            # per GDN layer and step, 36 of a 48-layer step's 51). The same bits. The default where
                            # op gdn_step runs the compiled kernel (`cinplace_default`) since its
                            # compiled tests passed and the 4-layer step at 8K measured 2 launches fewer and -7.3 us
                            # chained (H100, 2026-12-07); FNX_GDN_STEP_TILES=cinplace=0 turns it off


STEP_TILES_ENV = "FNX_GDN_STEP_TILES"


def cinplace_default() -> int:
    """`StepTiles.cinplace` by default: 1 where op "gdn_step" resolves to the compiled kernel (a CUDA GPU; not on a
    mesh, nor under `dispatch.force("reference")` or FNX_KERNELS naming the reference: there the model's GDN runs
    the reference, and a counter pool would be one more Pallas call for nothing), else 0."""
    from fnx.pallas import dispatch
    from fnx.pallas.gdn import api
    return int(dispatch.resolve(api.STEP_OP) == "pallas")


def conv_in_place() -> bool:
    """Whether the step kernel's default tiles update the conv window in place (`StepTiles.cinplace`: FNX_GDN_STEP_TILES
    when it names the field, else `cinplace_default`; read when a program is traced: the decode program then makes
    its counter pool, `fnx.model.transformer.counter_pool`)."""
    spec = os.environ.get(STEP_TILES_ENV)
    if spec:
        from fnx.pallas import dispatch
        fields = dispatch.fields_override(spec, StepTiles, STEP_TILES_ENV)
        if "cinplace" in fields:
            return bool(fields["cinplace"])
    return bool(cinplace_default())


def default_step_tiles(batch: int, hv: int, dv: int) -> StepTiles:
    """Whole heads (the norm fused) at 4 warps: the fastest of six tile sets on the H200 at the released widths,
    B = 1 and 8 (BV 128 at 4 / 8 / 16 warps, 64 at 4, 32 at 4 / 2; `bench.step_cases`, BENCHMARKS.md).
    The conv window in place where the kernel runs compiled (`cinplace_default`). `FNX_GDN_STEP_TILES` ("early=1",
    read when a program is traced) replaces fields: a benchmark knob."""
    return _env_tiles(StepTiles(block_v=dv, num_warps=4, cinplace=cinplace_default()), STEP_TILES_ENV, dv)


def _env_tiles(t, env: str, dv: int):
    """Tiles t with the fields the environment variable `env` names replaced ("field=value,..."), checked."""
    spec = os.environ.get(env)
    if spec:
        from fnx.pallas import dispatch
        t = dataclasses.replace(t, **dispatch.fields_override(spec, type(t), env))
        if t.block_v < 1 or t.block_v & (t.block_v - 1) or dv % t.block_v or t.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{env}={spec!r}: block_v must be a power of two dividing dv = {dv} and "
                             f"num_warps one of 1, 2, 4, 8, 16 (got {t})")
    return t



def _step_kernel(nv_ref, qkv_ref, conv_ref, cw_ref, b_ref, a_ref, alog_ref, dtb_ref, z_ref, nw_ref, s_ref,
                 *rest, conv_dim, taps, hk, dk, dv, bv, rep, eps, act, dt, win, early=False, cin=None):
    # win: (row width, start column) of qkv, z, b, a in the buffers they are read from (fused products: in place)
    # cin: StepTiles.cinplace's (first counter, readers per key head, interpret); its counters ref comes before the
    # outputs, and cout_ref is conv_ref's buffer (aliased)
    ctr_ref, (o_ref, sout_ref, cout_ref) = (rest[0], rest[1:]) if cin is not None else (None, rest)
    (wq, sq), (wz, sz), (wb, sb), (wa, sa) = win
    bi, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = h // rep
    s = s_ref[0, 0, :, :]                                   # [dk, BV] fp32: the state load is issued first
    valid = nv_ref[0] > 0
    hist = taps - 1

    def window_loads(off, n):
        """Channels [off, off + n): their conv window rows and the token's qkv values."""
        ch = off + jnp.arange(n, dtype=jnp.int32)
        rows = [pltriton.load(conv_ref.at[(bi * hist + t) * conv_dim + ch]) for t in range(hist)]
        return ch, rows, pltriton.load(qkv_ref.at[bi * wq + sq + ch])

    def conv_loads(off, n):     # StepTiles.early: the window and the conv weights, all now
        ch, rows, x = window_loads(off, n)
        return ch, rows, x, [pltriton.load(cw_ref.at[ch * taps + t]) for t in range(taps)]

    def conv(off, n, loaded=None):
        """silu(conv) of channels [off, off + n) (rounded like the model), and the window rows after the token.
        loaded: `conv_loads` made already (StepTiles.early); else each conv weight read where it multiplies, as
        first written (the default's code)."""
        ch, rows, x, ws = loaded if loaded is not None else (*window_loads(off, n), None)
        acc = jnp.zeros((n,), F32)
        for t, r in enumerate(rows + [x]):
            acc = acc + r.astype(F32) * (ws[t] if ws is not None else pltriton.load(cw_ref.at[ch * taps + t])
                                         ).astype(F32)
        y = rnd(acc, dt)
        y = rnd(y * rnd(jax.nn.sigmoid(y), dt), dt)       # jax.nn.silu in dt, rounded as its HLO does
        new = [jnp.where(valid, nxt, old) for old, nxt in zip(rows, rows[1:] + [x])]
        return y, ch, new

    def store_window(ch, new):
        for t, r in enumerate(new):
            pltriton.store(cout_ref.at[(bi * hist + t) * conv_dim + ch], r)

    def z_load():
        return pltriton.load(z_ref.at[bi * wz + sz + h * dv + j * bv + jnp.arange(bv, dtype=jnp.int32)])
    # StepTiles.early: the operands' loads before any arithmetic (else where each is used, as first written)
    lq = lk = lv = pre = None
    if early:
        lq, lk, lv = (conv_loads(kh * dk, dk), conv_loads(hk * dk + kh * dk, dk),
                      conv_loads(2 * hk * dk + h * dv + j * bv, bv))
        pre = (b_ref[bi * wb + sb + h], a_ref[bi * wa + sa + h], alog_ref[0], dtb_ref[0],
               z_load() if bv == dv else None, nw_ref[:] if bv == dv else None)
    q, qch, qnew = conv(kh * dk, dk, lq)
    k, kch, knew = conv(hk * dk + kh * dk, dk, lk)
    v, vch, vnew = conv(2 * hk * dk + h * dv + j * bv, bv, lv)
    if cin is None:
        store_window(vch, vnew)

        @pl.when((h % rep == 0) & (j == 0))
        def _():
            store_window(qch, qnew)
            store_window(kch, knew)
    else:
        # in place: every thread's window loads done before any row of the window is overwritten (the v rows are
        # this program's alone); the key head's q / k rows by the last of its readers to arrive, after the others
        # have loaded theirs (they arrived after their loads; the acquire-release add orders the stores after)
        base, readers, interpret = cin
        if not interpret:
            pltriton.debug_barrier()
        store_window(vch, vnew)
        old = pltriton.atomic_add(ctr_ref, (jnp.int32(base) + bi * hk + kh,), jnp.int32(1))

        @pl.when(old % readers == readers - 1)
        def _():
            store_window(qch, qnew)
            store_window(kch, knew)

    # (the operands from `pre`, or each read where it is used: the conditionals keep the default's order of reads)
    beta = rnd(jax.nn.sigmoid((pre[0] if early else b_ref[bi * wb + sb + h]).astype(F32)), dt)
    g = -jnp.exp((pre[2] if early else alog_ref[0]).astype(F32)) * softplus(
        (pre[1] if early else a_ref[bi * wa + sa + h]).astype(F32) + (pre[3] if early else dtb_ref[0]).astype(F32))
    g = jnp.where(valid, g, 0.0)
    beta = jnp.where(valid, beta, 0.0)
    q = q * lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS) * (dk ** -0.5)
    k = k * lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
    s = s * jnp.exp(g)
    kv = jnp.sum(s * k[:, None], axis=0)                    # [BV]
    s = s + k[:, None] * ((v - kv) * beta)[None, :]
    o = jnp.sum(s * q[:, None], axis=0)
    if bv == dv:
        zv = pre[4] if early else z_load()
        o_ref[0, 0, :] = _gated_norm(o, zv, pre[5] if early else nw_ref[:], eps, act, dt)
    else:
        o_ref[0, 0, :] = o.astype(dt)
    sout_ref[0, 0, :, :] = s


def gdn_step(qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec, n_valid, *, key_heads: int, eps: float,
             act: str, tiles: StepTiles | None = None, inplace: bool = False, interpret: bool = False):
    """See `fnx.pallas.gdn.api.gdn_step` (shapes are checked there). qkv, z, b and a: arrays or windows
    (buffer [B, 1, W], start column), see `kernel_math.window_operand`. inplace: the new recurrent state is written
    over `rec` (input_output_aliases; donate it, or XLA copies it first). `StepTiles.cinplace`: the conv window too
    (over `conv_state`), its counters from the program's `grid_sync.CounterPool` where one is in scope."""
    bsz = rec.shape[0]
    conv_dim, taps = conv_w.shape
    hv, dv = a_log.shape[0], norm_w.shape[0]
    dk = (conv_dim - hv * dv) // (2 * key_heads)
    ops = [window_operand(o, n, (bsz, 1), f"gdn_step {name}") for o, n, name in
           ((qkv, conv_dim, "qkv"), (z, hv * dv, "z"), (b, hv, "b"), (a, hv, "a"))]
    dt = ops[0][0].dtype
    t = tiles or default_step_tiles(bsz, hv, dv)
    bv = t.block_v
    whole = pl.BlockSpec(memory_space=pl.ANY)
    flat = lambda x: x.reshape(-1)  # noqa: E731
    in_specs = [pl.BlockSpec((1,), lambda i, h, j: (i,)), whole, whole, whole, whole, whole,
                pl.BlockSpec((1,), lambda i, h, j: (h,)), pl.BlockSpec((1,), lambda i, h, j: (h,)),
                whole, pl.BlockSpec((bv,), lambda i, h, j: (j,)),
                pl.BlockSpec((1, 1, dk, bv), lambda i, h, j: (i, h, 0, j))]
    out_specs = [pl.BlockSpec((1, 1, bv), lambda i, h, j: (i, h, j)),
                 pl.BlockSpec((1, 1, dk, bv), lambda i, h, j: (i, h, 0, j)), whole]
    out_shape = [jax.ShapeDtypeStruct((bsz, hv, dv), dt), jax.ShapeDtypeStruct(rec.shape, F32),
                 jax.ShapeDtypeStruct((conv_state.size,), conv_state.dtype)]
    params = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=t.num_warps, num_stages=1)}
    kernel = functools.partial(_step_kernel, conv_dim=conv_dim, taps=taps, hk=key_heads, dk=dk, dv=dv, bv=bv,
                               rep=hv // key_heads, eps=float(eps), act=act, dt=dt,
                               win=tuple((buf.shape[2], start) for buf, start in ops), early=bool(t.early))
    (qb, _), (zb, zs), (bb, _), (ab, _) = ops
    args = (n_valid.astype(jnp.int32), flat(qb), flat(conv_state), stacked.flatten(conv_w), flat(bb), flat(ab),
            a_log, dt_bias, flat(zb), norm_w, rec)
    aliases = {10: 1} if inplace else {}
    if t.cinplace:
        # the conv window in place (StepTiles.cinplace): one counter per (sequence, key head) for the q / k rows'
        # last reader, from the decode program's pool (a region per call site, kept a multiple of the readers by
        # each launch), else a fresh zeroed buffer of its own (`grid_sync.counters`)
        from fnx.pallas import grid_sync
        ctrs, base = grid_sync.counters(bsz * key_heads, interpret)
        kernel = functools.partial(kernel, cin=(base, (hv // key_heads) * (dv // bv), interpret))
        args, in_specs = args + (ctrs,), in_specs + [whole]
        aliases[2] = 2
    o, rec, conv = stacked.call(
        kernel, args, grid=(bsz, hv, dv // bv), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases, interpret=interpret, name="gdn_step", **params,
    )   # conv_w, a_log, dt_bias and norm_w may be layers of stacks (fnx.pallas.stacked): read in place
    if bv != dv:                                            # the norm over whole heads, after the kernel
        o = rms_norm_gated(o, take_window(zb[:, 0], zs, hv * dv).reshape(bsz, hv, dv), stacked.materialize(norm_w),
                           eps, act)
    return o.reshape(bsz, 1, hv, dv), conv.reshape(conv_state.shape), rec


# ---------------------------------------------------------------------------------------------------------------
# gdn_window: a verify window's GDN core in one kernel (op "gdn_window"): gdn_step for T tokens. The window's conv
# inputs are the conv state's K-1 rows and the T new rows (xcat); token t's conv reads rows t .. t + K-1. Besides o
# and the states after n_valid, the kernel writes what rollback replays from (`fnx.model.gdn.rec_after`,
# `window_after`): xcat, the conv outputs k [B, T, HK, dk] and v [B, T, HV, dv] (after silu, before the l2 norm),
# g and beta [B, T, HV] fp32, so none of them is an XLA op of its own. Each element of xcat, the new window and k
# is written by one program (the q / k channels by program j = 0 of a key head group's first value head, as in
# gdn_step); g and beta by every column tile of a head, the same values.


@dataclasses.dataclass(frozen=True)
class WindowTiles:
    block_v: int = 32       # BV (a power of two dividing dv); BV = dv fuses the gated norm
    num_warps: int = 4
    early: int = 0          # 1 = the conv weights, every token's b and a, A_log and dt_bias loaded with the window
                            # rows, before any arithmetic or store (as first written they are read after the conv
                            # window's stores, which no load may pass, and each token's b / a after the previous
                            # token's recurrence). The same bits. Built 2026-12-05, not yet measured:
                            # FNX_GDN_WINDOW_TILES=early=1


WINDOW_TILES_ENV = "FNX_GDN_WINDOW_TILES"


def default_window_tiles(dv: int) -> WindowTiles:
    """BV = 32 (4 programs per head at dv = 128; the norm after the kernel) at every batch. Whole heads (the norm in
    the kernel) measured 69.3 us per GDN layer against 8.4 at B = 1 (H200, thirty-second session, 8 warps: a
    [128, 128] fp32 state per program), a per-program cost a fuller grid at larger B does not pay back, so they are
    not the default there either (`default_tiles`' untuned rule for the recurrence kernel is not copied).
    `FNX_GDN_WINDOW_TILES` ("block_v=128,num_warps=8", read when a program is traced) replaces fields: a benchmark
    knob."""
    return _env_tiles(WindowTiles(block_v=min(32, dv)), WINDOW_TILES_ENV, dv)


def _window_kernel(nv_ref, qkv_ref, conv_ref, cw_ref, b_ref, a_ref, alog_ref, dtb_ref, z_ref, nw_ref, s_ref,
                   o_ref, sout_ref, cout_ref, cx_ref, k_ref, v_ref, g_ref, beta_ref, *, length, conv_dim, taps, hk,
                   hv, dk, dv, bv, rep, eps, act, dt, win, parts=None, early=False):
    (wq, sq), (wz, sz), (wb, sb), (wa, sa) = win
    bi, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    def ld(ref, idx, width):
        """An element (or vector) of a product operand: as stored, or with `parts` (S, Mp) the sum of its S split
        partials (fp32, in split order) rounded to dt, as the product's own split sum would have it."""
        if parts is None:
            return pltriton.load(ref.at[idx])
        acc = None
        for i in range(parts[0]):
            v = pltriton.load(ref.at[i * parts[1] * width + idx])
            acc = v if acc is None else acc + v
        return acc.astype(dt)
    kh = h // rep
    s = s_ref[0, 0, :, :]                                   # [dk, BV] fp32: the state load is issued first
    hist = taps - 1
    span = hist + length
    nv = jnp.minimum(jnp.maximum(nv_ref[0], 0), length)     # window_after's dynamic_slice clamps its start

    def rows_of(off, n):
        ch = off + jnp.arange(n, dtype=jnp.int32)
        rows = [pltriton.load(conv_ref.at[(bi * hist + r) * conv_dim + ch]).astype(dt) for r in range(hist)]
        rows += [ld(qkv_ref, (bi * length + t) * wq + sq + ch, wq) for t in range(length)]
        return ch, rows

    def conv_w(ch):
        return [pltriton.load(cw_ref.at[ch * taps + i]).astype(F32) for i in range(taps)]

    def conv(ch, rows, w=None):
        """silu(conv) per token (rounded like the model's causal_conv and silu); w: `conv_w(ch)` loaded already."""
        w = conv_w(ch) if w is None else w
        out = []
        for t in range(length):
            acc = jnp.zeros(ch.shape, F32)
            for i in range(taps):
                acc = acc + rows[t + i].astype(F32) * w[i]
            y = rnd(acc, dt)
            out.append(rnd(y * rnd(jax.nn.sigmoid(y), dt), dt))
        return out

    def store_rows(ch, rows):
        """xcat, and the window after nv tokens: rows nv .. nv + K-2 of xcat."""
        for r in range(span):
            pltriton.store(cx_ref.at[(bi * span + r) * conv_dim + ch], rows[r])
        for r in range(hist):
            new = rows[r]
            for n in range(1, length + 1):
                new = jnp.where(nv == n, rows[n + r], new)
            pltriton.store(cout_ref.at[(bi * hist + r) * conv_dim + ch], new)

    qch, qrows = rows_of(kh * dk, dk)
    kch, krows = rows_of(hk * dk + kh * dk, dk)
    vch, vrows = rows_of(2 * hk * dk + h * dv + j * bv, bv)
    pre = None
    if early:   # WindowTiles.early: the rest of the small operands now, before any arithmetic or store
        pre = ([conv_w(c) for c in (qch, kch, vch)],
               [(ld(b_ref, (bi * length + t) * wb + sb + h, wb), ld(a_ref, (bi * length + t) * wa + sa + h, wa))
                for t in range(length)], alog_ref[0], dtb_ref[0])
    ws = pre[0] if early else (None, None, None)
    qs, ks, vs = conv(qch, qrows, ws[0]), conv(kch, krows, ws[1]), conv(vch, vrows, ws[2])
    store_rows(vch, vrows)
    dj = jnp.arange(dk, dtype=jnp.int32)
    vj = jnp.arange(bv, dtype=jnp.int32)
    for t in range(length):
        pltriton.store(v_ref.at[((bi * length + t) * hv + h) * dv + j * bv + vj], vs[t].astype(v_ref.dtype))

    @pl.when((h % rep == 0) & (j == 0))
    def _():
        store_rows(qch, qrows)
        store_rows(kch, krows)
        for t_ in range(length):
            pltriton.store(k_ref.at[((bi * length + t_) * hk + kh) * dk + dj], ks[t_].astype(k_ref.dtype))

    a_log = -jnp.exp((pre[2] if early else alog_ref[0]).astype(F32))
    dtb = (pre[3] if early else dtb_ref[0]).astype(F32)
    for t in range(length):
        valid = t < nv
        bt = pre[1][t][0] if early else ld(b_ref, (bi * length + t) * wb + sb + h, wb)
        beta = rnd(jax.nn.sigmoid(bt.astype(F32)), dt)
        at = pre[1][t][1] if early else ld(a_ref, (bi * length + t) * wa + sa + h, wa)
        g = a_log * softplus(at.astype(F32) + dtb)
        g = jnp.where(valid, g, 0.0)
        beta = jnp.where(valid, beta, 0.0)
        g_ref[0, t, 0] = g
        beta_ref[0, t, 0] = beta
        q, k = qs[t], ks[t]
        q = q * lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS) * (dk ** -0.5)
        k = k * lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
        s = s * jnp.exp(g)
        kv = jnp.sum(s * k[:, None], axis=0)                # [BV]
        s = s + k[:, None] * ((vs[t] - kv) * beta)[None, :]
        o = jnp.sum(s * q[:, None], axis=0)
        if bv == dv:
            zv = ld(z_ref, (bi * length + t) * wz + sz + h * dv + j * bv + vj, wz)
            o_ref[0, t, 0, :] = _gated_norm(o, zv, nw_ref[:], eps, act, dt)
        else:
            o_ref[0, t, 0, :] = o.astype(dt)
    sout_ref[0, 0, :, :] = s


def gdn_window(qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec, n_valid, *, key_heads: int,
               eps: float, act: str, tiles: WindowTiles | None = None, interpret: bool = False):
    """See `fnx.pallas.gdn.api.gdn_window` (shapes are checked there). qkv, z, b and a: arrays or windows (buffer
    [B, T, W], start column), read in place. The new recurrent state is a new buffer: rollback replays from `rec`.
    Returns (o [B, T, HV, dv], conv_state after n_valid, rec after n_valid, {"conv_x", "k", "v", "g", "beta"})."""
    bsz = rec.shape[0]
    conv_dim, taps = conv_w.shape
    hv, dv = a_log.shape[0], norm_w.shape[0]
    dk = (conv_dim - hv * dv) // (2 * key_heads)
    q_arr = qkv[0] if isinstance(qkv, tuple) else qkv
    length = q_arr.lead[1] if isinstance(q_arr, Partials) else q_arr.shape[1]
    ops = [window_operand(o, n, (bsz, length), f"gdn_window {name}") for o, n, name in
           ((qkv, conv_dim, "qkv"), (z, hv * dv, "z"), (b, hv, "b"), (a, hv, "a"))]
    # split partials (kernel_math.Partials): summed in the kernel where all four are windows of one product,
    # else summed first (XLA adds)
    parts = None
    held = [buf for buf, _ in ops if isinstance(buf, Partials)]
    if held and len(held) == 4 and all(buf is held[0] for buf in held):
        parts = (held[0].splits, held[0].buf.shape[1])
    elif held:
        ops = [(buf.window(), start) if isinstance(buf, Partials) else (buf, start) for buf, start in ops]
    dt = ops[0][0].dtype
    t = tiles or default_window_tiles(dv)
    bv = t.block_v
    hist = taps - 1
    whole = pl.BlockSpec(memory_space=pl.ANY)
    flat = lambda x: x.reshape(-1)  # noqa: E731
    per_head = pl.BlockSpec((1, length, 1), lambda i, h, j: (i, 0, h))
    in_specs = [pl.BlockSpec((1,), lambda i, h, j: (i,)), whole, whole, whole, whole, whole,
                pl.BlockSpec((1,), lambda i, h, j: (h,)), pl.BlockSpec((1,), lambda i, h, j: (h,)),
                whole, pl.BlockSpec((bv,), lambda i, h, j: (j,)),
                pl.BlockSpec((1, 1, dk, bv), lambda i, h, j: (i, h, 0, j))]
    out_specs = [pl.BlockSpec((1, length, 1, bv), lambda i, h, j: (i, 0, h, j)),
                 pl.BlockSpec((1, 1, dk, bv), lambda i, h, j: (i, h, 0, j)), whole, whole, whole, whole,
                 per_head, per_head]
    out_shape = [jax.ShapeDtypeStruct((bsz, length, hv, dv), dt), jax.ShapeDtypeStruct(rec.shape, F32),
                 jax.ShapeDtypeStruct((conv_state.size,), dt),        # in qkv's dtype, as the model's xcat
                 jax.ShapeDtypeStruct((bsz * (hist + length) * conv_dim,), dt),
                 jax.ShapeDtypeStruct((bsz * length * key_heads * dk,), dt),
                 jax.ShapeDtypeStruct((bsz * length * hv * dv,), dt),
                 jax.ShapeDtypeStruct((bsz, length, hv), F32), jax.ShapeDtypeStruct((bsz, length, hv), F32)]
    params = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=t.num_warps, num_stages=1)}
    kernel = functools.partial(_window_kernel, length=length, conv_dim=conv_dim, taps=taps, hk=key_heads, hv=hv,
                               dk=dk, dv=dv, bv=bv, rep=hv // key_heads, eps=float(eps), act=act, dt=dt,
                               win=tuple((held[0].width if parts else buf.shape[-1], start) for buf, start in ops),
                               parts=parts, early=bool(t.early))
    (qb, _), (zb, zs), (bb, _), (ab, _) = ops
    zk = zb
    if parts is not None:       # the four operands are the one partials buffer [S, Mp, W]
        qb = bb = ab = zk = held[0].buf
    o, rec, conv, cx, k, v, g, beta = stacked.call(
        kernel, (n_valid.astype(jnp.int32), flat(qb), flat(conv_state), stacked.flatten(conv_w), flat(bb), flat(ab),
                 a_log, dt_bias, flat(zk), norm_w, rec),
        grid=(bsz, hv, dv // bv), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name="gdn_window", **params,
    )   # conv_w, a_log, dt_bias and norm_w may be layers of stacks (fnx.pallas.stacked): read in place
    if bv != dv:                                            # the norm over whole heads, after the kernel
        zw = take_window(zb, zs, hv * dv).reshape(bsz, length, hv, dv)
        o = rms_norm_gated(o, zw, stacked.materialize(norm_w), eps, act)
    parts = {"conv_x": cx.reshape(bsz, hist + length, conv_dim), "k": k.reshape(bsz, length, key_heads, dk),
             "v": v.reshape(bsz, length, hv, dv), "g": g, "beta": beta}
    return o, conv.reshape(conv_state.shape), rec, parts


# ---- prefill: the chunks' sequential pass (op "gdn_prefill") ------------------------------------------------------
#
# Grid (B, H, dv / BV): program (b, h, j) keeps columns [j BV, (j+1) BV) of head h's fp32 state in registers and
# walks the N chunks in order. Per chunk: v_new = nv - kcd S, o = q S + intra v_new (stored), S = S * decay +
# k^T v_new: four [C x dk] / [C x C] by [dk | C x BV] products in fp32 (ScanTiles.precision).
# The chunk-local quantities (the UT inverse and its products) come from batched XLA ops before it.
#
# "ieee" products (Precision.HIGHEST) are what the H200 measured (0400fd0): 6.7 ms for 1K tokens against 0.69 ms for
# XLA's scan. Triton computes an "ieee" fp32 product on the CUDA cores, not the tensor cores, and the [C x dk]
# operands of such products sit in registers. "tf32x3" splits each fp32 operand into a tf32 high and low part and
# sums three tensor-core products (about fp32 accuracy); "tf32" is one product (10 mantissa bits). Measured on the
# H200 (89aa848, BV 32, 4 warps): "tf32x3" 0.42 ms for 1K tokens and 3.07 ms for 8K, against XLA's scan 0.69 and
# 5.01 ms ("tf32" 0.17 / 1.14 ms, BV 64 or 8 warps slower), and its compiled test meets the 1e-5 bound of the fp32
# scan (0400fd0): so "tf32x3" was the default and `auto` runs the kernel.
# "tf32" is the default since the fiftieth session (H100, 4a8ea81): with the one-launch chunk prep (op
# "gdn_chunk_prep", whose products take the same precision) a 4-layer 2,048-token prefill chunk took 14.79 ms
# against 16.93 with "tf32x3" and XLA's prep (-12.7%), and the trained fnx-mini's next-token distributions moved by
# KL 1.2e-3 from the "tf32x3" run (top-1 98.1%, perplexity +0.04%), where "ieee" moves them 7e-4 (any change at
# all, from the bf16 model's rounding) and the float32 model 1.5e-3 (BENCHMARKS, fiftieth session).
# FNX_GDN_SCAN_TILES=precision=tf32x3 takes the more exact products back (and XLA's prep: the kernel's tf32x3 is
# slower than it).
SCAN_PRECISIONS = ("ieee", "tf32x3", "tf32")


@dataclasses.dataclass(frozen=True)
class ScanTiles:
    block_v: int = 32       # BV: state columns per program (a power of two dividing dv, at least 16)
    num_warps: int = 4
    num_stages: int = 1
    precision: str = "tf32"     # one of SCAN_PRECISIONS (the interpreter computes every one at HIGHEST)
    # 1: where the caller asks for o in its tokens' layout ([B, L, H, dv] in its dtype, `api.gdn_chunk_scan`
    # `tokens`), the kernel stores it so (rows past L masked), and the transposing conversion XLA runs after it
    # otherwise (a [2,048, 48, 128] bf16 one: ~53 us a GDN layer on the H100) goes; 0: o stored [B, H, N, C, dv]
    # fp32 and XLA rearranges it. The same bits either way (both round fp32 to the dtype to nearest even). Off:
    # level (H100, fifty-first session: the scan +84 us for three layers, the 4-layer 2,048-token chunk -0.2%)
    tokens_out: int = 0


SCAN_TILES_ENV = "FNX_GDN_SCAN_TILES"     # a benchmark knob: fields replaced in the chunk scan's default tiles


def scan_tiles(dv: int) -> ScanTiles:
    """The chunk scan's default tiles (block_v 32, or dv if smaller), with the fields FNX_GDN_SCAN_TILES names
    replaced (e.g. "block_v=16"; read when a program is traced)."""
    t = ScanTiles(block_v=min(32, dv))
    spec = os.environ.get(SCAN_TILES_ENV, "").strip()
    if spec:
        from fnx.pallas import dispatch
        t = dataclasses.replace(t, **dispatch.fields_override(spec, ScanTiles, SCAN_TILES_ENV, ("precision",)))
    return t


def scan_precision(name: str, interpret: bool):
    """The dot precision a ScanTiles.precision name asks for (HIGHEST in the interpreter)."""
    if interpret:       # XLA:CPU has no TF32 algorithms: the interpreter checks the arithmetic at fp32
        return lax.Precision.HIGHEST
    return {"ieee": lax.Precision.HIGHEST, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
            "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32}[name]


def _chunk_scan_kernel(nv_ref, kcd_ref, q_ref, ia_ref, k_ref, cd_ref, s_ref, o_ref, sout_ref, *, n, bv, precision,
                       tokens=None):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * bv, bv)
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=F32)

    def body(i, s):
        nv = nv_ref[b, h, i, :, cols]                       # [C, BV]
        kcd, qi, ki = kcd_ref[b, h, i], q_ref[b, h, i], k_ref[b, h, i]     # [C, dk]
        v_new = nv - dot(kcd, s)
        o = dot(qi, s) + dot(ia_ref[b, h, i], v_new)
        if tokens is None:
            o_ref[b, h, i, :, cols] = o
        else:       # rows (b, t, h) of the caller's [B * L * H, dv]: the chunk's tokens in range only
            length, heads, dtype = tokens
            c = o.shape[0]
            t = i * c + jnp.arange(c, dtype=jnp.int32)
            # not clamped: the masked rows' indices stay distinct (the interpreter's masked store writes back
            # what it read at each index, so two lanes on one row could race; a GPU never touches them)
            rows = (b * length + t) * heads + h
            cc = j * bv + jnp.arange(bv, dtype=jnp.int32)
            pltriton.store(o_ref.at[rows[:, None], cc[None, :]], o.astype(dtype),
                           mask=jnp.broadcast_to((t < length)[:, None], (c, bv)))
        return s * cd_ref[b, h, i] + dot(ki.T, v_new)

    sout_ref[b, h, :, cols] = lax.fori_loop(0, n, body, s_ref[b, h, :, cols])


def chunk_scan(new_values, k_cumdecay, q, intra, k, chunk_decay, state, *, interpret: bool = False,
               tiles: ScanTiles | None = None, tokens=None):
    """`api.gdn_chunk_scan` in one launch (shapes checked there): (o [B, H, N, C, dv] fp32, final state fp32);
    with `tokens` (length L, dtype) o comes as [B, L, H, dv] in that dtype, stored so by the kernel."""
    bsz, h, n, c, dv = new_values.shape
    t = tiles or scan_tiles(dv)
    if dv % t.block_v or t.block_v < 16 or t.block_v & (t.block_v - 1):
        raise ValueError(f"gdn chunk_scan: block_v {t.block_v} must be a power of two >= 16 dividing dv={dv}")
    if t.precision not in SCAN_PRECISIONS:
        raise ValueError(f"gdn chunk_scan: precision {t.precision!r} must be one of {SCAN_PRECISIONS}")
    params = {} if interpret else {"compiler_params": pltriton.CompilerParams(num_warps=t.num_warps,
                                                                              num_stages=t.num_stages)}
    if tokens is not None:
        length, dtype = tokens
        if not 0 < length <= n * c:
            raise ValueError(f"gdn chunk_scan: {length} tokens do not fit {n} chunks of {c}")
        o_shape = jax.ShapeDtypeStruct((bsz * length * h, dv), dtype)
        tokens = (length, h, jnp.dtype(dtype))
    else:
        o_shape = jax.ShapeDtypeStruct(new_values.shape, F32)
    o, s = pdl.pallas_call(
        functools.partial(_chunk_scan_kernel, n=n, bv=t.block_v, precision=scan_precision(t.precision, interpret),
                          tokens=tokens),
        grid=(bsz, h, dv // t.block_v),
        out_shape=(o_shape, jax.ShapeDtypeStruct(state.shape, F32)),
        interpret=interpret, name="gdn_chunk_scan", **params,
    )(new_values, k_cumdecay, q, intra, k, chunk_decay, state)
    return (o if tokens is None else o.reshape(bsz, tokens[0], h, dv)), s
