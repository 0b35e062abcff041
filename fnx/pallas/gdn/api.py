"""`gdn_recurrent`: the gated delta rule for a few tokens per sequence (decode, MTP verify), dispatched between the
jnp reference and the Pallas (Triton lowering) kernel. Op name for FNX_KERNELS: "gdn_decode"."""

from __future__ import annotations

import jax.numpy as jnp

from fnx.pallas import dispatch
from fnx.pallas.kernel_math import Partials, take_window, window_operand
from fnx.pallas.gdn import reference

OP = "gdn_decode"
F32 = jnp.float32


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


REPLAY_CONV_OP = "gdn_replay_conv"


def gdn_recurrent(q, k, v, g, beta, state, keep_steps: bool = False, impl: str | None = None, *,
                  scale: float | None = None, qk_l2norm: bool = False, steps_with_initial: bool = False,
                  out_dtype=F32, inplace: bool = False, tiles=None, norm=None, n_keep=None, want_o: bool = True,
                  conv=None):
    """Run T tokens of the gated delta rule on an fp32 state, token by token.

    q, k [B, T, HK, dk] (any float dtype); v [B, T, HV, dv]; g (log decay), beta [B, T, HV] fp32;
    state [B, HV, dk, dv] fp32. HV must be a multiple of HK: value head h reads key head h // (HV // HK).
    Per token: S = exp(g) S; S += k (beta (v - k^T S)); o = q^T S (o read after the update).
    qk_l2norm: q and k are l2-normalised in fp32 first (eps 1e-6 in the rsqrt); scale: q is multiplied by it after.
    A token with g = 0 and beta = 0 leaves the state exactly as it was (padding; re-running a verify window with the
    rejected tokens masked that way gives the rolled-back state).
    Returns (o [B, T, HV, dv] in out_dtype, final state [B, HV, dk, dv] fp32) and with keep_steps also the state
    after every token [B, T, HV, dk, dv] ([B, T+1, ...] with steps_with_initial: index 0 is the input state).
    inplace: the kernel writes the final state over the input state's buffer (donate it, or XLA copies it first).
    norm: None or (z [B, T, HV, dv], weight [dv], eps, act "sigmoid"|"silu"): o becomes the GDN output norm
    `rms_norm_gated(o in out_dtype, z, weight, eps, act)`, fused into the kernel (which then takes a whole head,
    BV = dv, per program).
    n_keep: None or [B] int: row b's tokens t >= n_keep[b] are no-ops (g = 0 and beta = 0 for them, applied inside
    the kernel: no select kernels in front of it), as the rollback's replay of a verify window needs.
    want_o False: the state alone (the replay discards o): the kernel skips each token's q . S reduction and o's
    store, and None is returned in o's place (not with norm).
    conv: None or (conv_x [B, W + T, C], W) with n_keep (the rollback's replay): the conv state after the kept
    tokens, rows [n_keep, n_keep + W) of conv_x, is returned last [B, W, C]. Op "gdn_replay_conv" (with the kernel
    here on a Pallas backend) has the replay's programs copy it; otherwise it is `reference.window_after`, an XLA
    gather of its own.
    impl: None/"auto", "reference", "pallas", "pallas_interpret" (fnx.pallas.dispatch)."""
    bsz, length, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if q.shape != k.shape:
        raise ValueError(f"gdn_recurrent: q {q.shape} and k {k.shape} must have the same shape [B, T, HK, dk]")
    if v.shape[:2] != (bsz, length) or hv % hk:
        raise ValueError(f"gdn_recurrent: v {v.shape} must be [B={bsz}, T={length}, HV, dv] with HV a multiple of "
                         f"HK={hk}")
    for name, a in (("g", g), ("beta", beta)):
        if a.shape != (bsz, length, hv):
            raise ValueError(f"gdn_recurrent: {name} {a.shape} must be [B, T, HV] = {(bsz, length, hv)}")
    if state.shape != (bsz, hv, dk, dv) or state.dtype != F32:
        raise ValueError(f"gdn_recurrent: state {state.shape} {state.dtype} must be fp32 {(bsz, hv, dk, dv)}")
    if norm is not None and (len(norm) != 4 or norm[0].shape != v.shape or norm[1].shape != (dv,)
                             or norm[3] not in ("sigmoid", "silu")):
        raise ValueError(f"gdn_recurrent: norm must be (z {v.shape}, weight ({dv},), eps, 'sigmoid'|'silu')")
    if not want_o and norm is not None:
        raise ValueError("gdn_recurrent: a gated norm applies to o, which want_o=False does not compute")
    if n_keep is not None and tuple(n_keep.shape) != (bsz,):
        raise ValueError(f"gdn_recurrent: n_keep {tuple(n_keep.shape)} must be [B] = {(bsz,)}")
    if conv is not None and (n_keep is None or keep_steps or len(conv) != 2 or conv[0].ndim != 3
                             or conv[0].shape[:2] != (bsz, conv[1] + length)):
        raise ValueError("gdn_recurrent: conv must be (conv_x [B, W + T, C], W) for the rollback's replay (n_keep "
                         f"given, no per-step states); got {None if conv is None else tuple(conv[0].shape)}")
    why = None                                        # the Triton lowering's tensors are powers of two
    if not (_is_pow2(dk) and _is_pow2(dv)):
        why = f"the kernel needs power-of-two head dims (dk={dk}, dv={dv})"
    backend = dispatch.resolve(OP, impl, not_applicable=why,
                               prefer_reference=ONE_TOKEN_REASON if length == 1 else None)
    fold = None
    if conv is not None:    # the conv copy in the replay's programs, or the reference's gather after the kernel
        conv_backend = dispatch.resolve(REPLAY_CONV_OP, None, not_applicable=(
            f"the replay runs the reference (op {OP})" if backend == "reference" else None))
        fold = conv if conv_backend != "reference" else None
    after = () if conv is None or fold is not None else (reference.window_after(conv[0], n_keep, conv[1]),)
    if backend == "reference":
        if n_keep is not None:
            keep = (jnp.arange(length)[None, :] < n_keep[:, None])[..., None]          # [B, T, 1]
            g, beta = jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)
        res = reference.gdn_recurrent(q, k, v, g, beta, state, keep_steps, scale=scale, qk_l2norm=qk_l2norm,
                                      steps_with_initial=steps_with_initial, out_dtype=out_dtype,
                                      norm=norm)
        return (res if want_o else (None,) + tuple(res[1:])) + after
    from fnx.pallas.gdn import pallas as kernel
    if tiles is not None and (not _is_pow2(tiles.block_v) or dv % tiles.block_v):
        raise ValueError(f"gdn_recurrent: block_v={tiles.block_v} must be a power of two dividing dv={dv}")
    return kernel.gdn_recurrent(q, k, v, g.astype(F32), beta.astype(F32), state, keep_steps, scale=scale,
                                qk_l2norm=qk_l2norm, steps_with_initial=steps_with_initial, out_dtype=out_dtype,
                                inplace=inplace, tiles=tiles, interpret=dispatch.interpret_flag(backend),
                                norm=norm, n_keep=n_keep, want_o=want_o, conv=fold) + after


# "auto" and the recurrence kernel, by measurement on the H200: for one token it gave no gain in the whole step
# (1.170 ms with the kernel, 1.164 with its XLA reference: 4 layers bf16, 2026-11-30, commit e7dd728; BENCHMARKS.md
# fourth session; decode steps now run gdn_step instead); for a verify window of 5 tokens it took 95 us against the
# reference's 516 us in isolation (B = 8; BENCHMARKS.md, kernels), where XLA runs the window token by token.
ONE_TOKEN_REASON = ("one token: the recurrence kernel gave no gain in the whole decode step (1.170 vs 1.164 ms, "
                    "BENCHMARKS.md fourth H200 session); verify windows of several tokens take it")

STEP_OP = "gdn_step"


def _core_operands(what, length, qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec, n_valid,
                   key_heads, act):
    """The shape checks `gdn_step` and `gdn_window` share (T = length tokens per sequence): clear errors for what
    does not fit. Returns (B, C, K, HV, dv, dk, the (buffer, start) operands of qkv, z, b and a, why the kernel
    cannot run or None)."""
    if conv_w.ndim != 2 or a_log.ndim != 1 or norm_w.ndim != 1 or rec.ndim != 4:
        raise ValueError(f"{what}: conv_w {tuple(conv_w.shape)} must be [C, K], a_log {tuple(a_log.shape)} [HV], "
                         f"norm_w {tuple(norm_w.shape)} [dv], rec {tuple(rec.shape)} [B, HV, dk, dv]")
    bsz = rec.shape[0]
    conv_dim, taps = conv_w.shape
    hv, dv = a_log.shape[0], norm_w.shape[0]
    if not isinstance(qkv, tuple) and tuple(qkv.shape) != (bsz, length, conv_dim):
        tokens = "one token" if length == 1 else f"{length} tokens"
        raise ValueError(f"{what}: {tokens} per sequence: qkv {tuple(qkv.shape)} must be [B, T, C] = "
                         f"{(bsz, length, conv_dim)}")
    if not isinstance(z, tuple) and tuple(z.shape) != (bsz, length, hv, dv):
        raise ValueError(f"{what}: z {tuple(z.shape)} must be [B, T, HV, dv] = {(bsz, length, hv, dv)}")
    if hv % key_heads or (conv_dim - hv * dv) <= 0 or (conv_dim - hv * dv) % (2 * key_heads):
        raise ValueError(f"{what}: C={conv_dim} is not 2 * {key_heads} key heads * dk + HV={hv} * dv={dv} "
                         f"(HV a multiple of the key heads)")
    dk = (conv_dim - hv * dv) // (2 * key_heads)
    for name, arr in (("b", b), ("a", a)):
        if not isinstance(arr, tuple) and tuple(arr.shape) != (bsz, length, hv):
            raise ValueError(f"{what}: {name} {tuple(arr.shape)} must be {(bsz, length, hv)}")
    ops = [window_operand(o, n, (bsz, length), f"{what} {name}") for o, n, name in
           ((qkv, conv_dim, "qkv"), (z, hv * dv, "z"), (b, hv, "b"), (a, hv, "a"))]
    want = {"conv_state": (conv_state, (bsz, max(taps - 1, 0), conv_dim)), "dt_bias": (dt_bias, (hv,)),
            "rec": (rec, (bsz, hv, dk, dv)), "n_valid": (n_valid, (bsz,))}
    for name, (arr, shape) in want.items():
        if tuple(arr.shape) != shape:
            raise ValueError(f"{what}: {name} {tuple(arr.shape)} must be {shape}")
    if taps < 2:
        raise ValueError(f"{what}: the conv needs at least 2 taps, conv_w is {tuple(conv_w.shape)}")
    if rec.dtype != F32:
        raise ValueError(f"{what}: the recurrent state must be fp32, got {rec.dtype}")
    if act not in ("sigmoid", "silu"):
        raise ValueError(f"{what}: act must be 'sigmoid' or 'silu', got {act!r}")
    why = None
    if not (_is_pow2(dk) and _is_pow2(dv)):
        why = f"the kernel needs power-of-two head dims (dk={dk}, dv={dv})"
    return bsz, conv_dim, taps, hv, dv, dk, ops, why


def gdn_step(qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec, n_valid, impl: str | None = None, *,
             key_heads: int, eps: float, act: str, inplace: bool = False, tiles=None):
    """One decode token per sequence through a GDN layer's core: causal conv update + silu, the beta / decay gates,
    the gated delta rule and the gated output norm (`reference.gdn_step` has the math and the shapes:
    qkv [B, 1, C], z [B, 1, HV, dv], b, a [B, 1, HV], conv_state [B, K-1, C], conv_w [C, K], a_log, dt_bias [HV],
    norm_w [dv], rec [B, HV, dk, dv] fp32, n_valid [B]). qkv, z, b and a may also be windows (buffer [B, 1, W],
    start column) into the fused input projections' products: the kernel reads them in place (a slice feeding a
    launch would be a copy kernel of its own); the reference slices them. Returns (o [B, 1, HV, dv], conv_state,
    rec).
    Op "gdn_step": the kernel does it all in one launch; its reference is the model's ops with the recurrence
    dispatched as "gdn_decode". tiles: `pallas.StepTiles` (BV columns of a head per program; BV < dv puts the
    norm after the kernel). The kernel rounds where the model rounds (conv, silu, sigmoid, norm), so fp32 runs
    agree to float error and bf16 runs to a rounding step where XLA keeps excess precision."""
    bsz, conv_dim, _, hv, dv, _, ops, why = _core_operands("gdn_step", 1, qkv, z, b, a, conv_state, conv_w, a_log,
                                                           dt_bias, norm_w, rec, n_valid, key_heads, act)
    backend = dispatch.resolve(STEP_OP, impl, not_applicable=why)
    if backend == "reference":
        from fnx.pallas.stacked import materialize       # layers of stacks: the reference slices them
        conv_w, a_log, dt_bias, norm_w = (materialize(x) for x in (conv_w, a_log, dt_bias, norm_w))
        qkv, z, b, a = (take_window(buf, s, n) for (buf, s), n in zip(ops, (conv_dim, hv * dv, hv, hv)))
        return reference.gdn_step(qkv, z.reshape(bsz, 1, hv, dv), b, a, conv_state, conv_w, a_log, dt_bias, norm_w,
                                  rec, n_valid, key_heads=key_heads, eps=eps, act=act, recurrent=gdn_recurrent)
    from fnx.pallas.gdn import pallas as kernel
    if tiles is not None and (not _is_pow2(tiles.block_v) or dv % tiles.block_v):
        raise ValueError(f"gdn_step: block_v={tiles.block_v} must be a power of two dividing dv={dv}")
    return kernel.gdn_step(qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec, n_valid,
                           key_heads=key_heads, eps=eps, act=act, inplace=inplace, tiles=tiles,
                           interpret=dispatch.interpret_flag(backend))


WINDOW_OP = "gdn_window"
WINDOW_PARTS_OP = "gdn_window_parts"


def window_takes_partials() -> bool:
    """Whether a verify window's GDN layer asks for its input projections as split-K partials, summed where
    `gdn_window` reads them (op "gdn_window_parts": no sum kernel between the product and the window kernel; the
    z window the norm after the kernel reads is summed by XLA adds fused into that norm)."""
    return dispatch.resolve(WINDOW_PARTS_OP, None) != "reference"


def gdn_window(qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec, n_valid, impl: str | None = None, *,
               key_heads: int, eps: float, act: str, tiles=None):
    """A verify window (T tokens per sequence, the first n_valid [B] of them real) through a GDN layer's core:
    `gdn_step` for T tokens, plus what rollback replays from. Shapes as `gdn_step` with T for 1: qkv [B, T, C],
    z [B, T, HV, dv], b, a [B, T, HV] (or windows (buffer [B, T, W], start) into the fused products, read in place
    by the kernel). Returns (o [B, T, HV, dv] normed, conv_state after n_valid, rec after n_valid, parts) with
    parts = {"conv_x" [B, K-1+T, C], "k" [B, T, HK, dk], "v" [B, T, HV, dv] (conv and silu, before the l2 norm),
    "g", "beta" [B, T, HV] fp32 (0 past n_valid)}: `fnx.model.gdn.rec_after` and `window_after` take them.
    `rec` is not overwritten (the replay starts from it).
    Op "gdn_window": one kernel for the conv, the gates, the recurrence and (whole heads per program) the norm; its
    reference is the model's ops (`reference.conv_and_gates`, then `gdn_recurrent`, dispatched as "gdn_decode")."""
    q_arr = qkv[0] if isinstance(qkv, tuple) else qkv
    q_shape = (*q_arr.lead, q_arr.width) if isinstance(q_arr, Partials) else tuple(q_arr.shape)
    if len(q_shape) != 3 or rec.ndim != 4 or q_shape[0] != rec.shape[0]:
        raise ValueError(f"gdn_window: qkv {q_shape} must be [B, T, C] with B = rec's batch "
                         f"(rec {tuple(rec.shape)})")
    length = q_shape[1]
    bsz, conv_dim, _, hv, dv, dk, ops, why = _core_operands("gdn_window", length, qkv, z, b, a, conv_state, conv_w,
                                                            a_log, dt_bias, norm_w, rec, n_valid, key_heads, act)
    backend = dispatch.resolve(WINDOW_OP, impl, not_applicable=why)
    if backend == "reference":
        from fnx.pallas.stacked import materialize       # layers of stacks: the reference slices them
        conv_w, a_log, dt_bias, norm_w = (materialize(x) for x in (conv_w, a_log, dt_bias, norm_w))
        qkv, z, b, a = (take_window(buf, s, n) for (buf, s), n in zip(ops, (conv_dim, hv * dv, hv, hv)))
        q, k, v, g, beta, conv_state, conv_x = reference.conv_and_gates(
            qkv, b, a, conv_state, conv_w, a_log, dt_bias, n_valid, key_heads=key_heads, key_head_dim=dk,
            value_heads=hv)
        o, rec = gdn_recurrent(q, k, v, g, beta, rec, scale=dk ** -0.5, qk_l2norm=True, out_dtype=qkv.dtype,
                               norm=(z.reshape(bsz, length, hv, dv), norm_w, eps, act))
        return o, conv_state, rec, {"conv_x": conv_x, "k": k, "v": v, "g": g, "beta": beta}
    from fnx.pallas.gdn import pallas as kernel
    if tiles is not None and (not _is_pow2(tiles.block_v) or dv % tiles.block_v):
        raise ValueError(f"gdn_window: block_v={tiles.block_v} must be a power of two dividing dv={dv}")
    return kernel.gdn_window(qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec, n_valid,
                             key_heads=key_heads, eps=eps, act=act, tiles=tiles,
                             interpret=dispatch.interpret_flag(backend))


OP_CHUNK_PREP = "gdn_chunk_prep"


def chunk_prep_auto_reason(precision: str) -> str | None:
    """Why "auto" keeps XLA's products for the chunk prep at the chunked path's `precision` (None: the kernel).
    H100, 2,048 tokens, 48 heads, a layer: the kernel 284 us with "tf32" products against XLA's 592 (its fp32
    products); with "tf32x3" 834 us (three products each and their operand splits), so XLA keeps those."""
    if precision == "tf32":
        return None
    return f"its {precision!r} products measured slower than XLA's (H100: 834 against 592 us a layer at 2,048 tokens)"


def _chunk_prep_backend(dk: int, dv: int, chunk: int, impl: str | None) -> str:
    """Op "gdn_chunk_prep"'s backend for these shapes (the refusal or auto's reason where the kernel does not
    serve them)."""
    why = None
    if not (_is_pow2(dk) and _is_pow2(dv) and _is_pow2(chunk)) or min(dk, dv, chunk) < 16 or dk > CHUNK_SCAN_MAX_DK:
        why = (f"the kernel's whole-chunk tiles need a power-of-two chunk ({chunk}) and power-of-two head dims "
               f"(dk {dk}, dv {dv}), each at least 16, dk <= {CHUNK_SCAN_MAX_DK}")
    from fnx.pallas.gdn import pallas as scan_kernel
    return dispatch.resolve(OP_CHUNK_PREP, impl, not_applicable=why,
                            prefer_reference=chunk_prep_auto_reason(scan_kernel.scan_tiles(dv).precision))


def _prep_kernel(backend: str, dv: int, *args, **kw):
    """`prep.chunk_prep` on `backend` ("pallas" or "pallas_interpret"), its products at the chunk scan's
    precision."""
    from fnx.pallas.gdn import pallas as scan_kernel
    from fnx.pallas.gdn import prep
    return prep.chunk_prep(*args, precision=scan_kernel.scan_precision(scan_kernel.scan_tiles(dv).precision, False),
                           interpret=dispatch.interpret_flag(backend), **kw)


def gdn_chunk_prep(q, k, v, g, beta, chunk: int, *, precision=None, apart=lambda a: a, impl: str | None = None,
                   rep: int = 1):
    """The per-chunk part of the chunked gated delta rule (`reference.chunk_prep` has the shapes and outputs):
    XLA's batched products (the reference, at `precision`, HIGHEST by default; `apart` the model's barrier
    between products sharing an operand) or one Pallas launch (`prep.chunk_prep`, its products at the chunk
    scan's precision, `ScanTiles.precision`). q and k may hold the key heads only (`rep` > 1: value head h reads
    key head h // rep, `jnp.repeat` order): the reference repeats them, the kernel reads them in place. Op name
    for FNX_KERNELS: "gdn_chunk_prep" ("auto": the kernel with "tf32" products, the default; XLA's with the
    others, `chunk_prep_auto_reason`)."""
    from jax import lax
    bsz, length, hk, dk = k.shape
    h, dv = v.shape[2:]
    if rep < 1 or hk * rep != h:
        raise ValueError(f"gdn_chunk_prep: {hk} key heads x rep {rep} must be v's {h} value heads")
    for name, a, want in (("q", q, (bsz, length, hk, dk)), ("v", v, (bsz, length, h, dv)),
                          ("g", g, (bsz, length, h)), ("beta", beta, (bsz, length, h))):
        if a.shape != want:
            raise ValueError(f"gdn_chunk_prep: {name} {a.shape} must be {want} (k is {k.shape}, rep {rep})")
    backend = _chunk_prep_backend(dk, dv, chunk, impl)
    if backend == "reference":
        if rep > 1:
            q, k = (jnp.repeat(t, rep, axis=2) for t in (q, k))
        return reference.chunk_prep(q, k, v, g, beta, chunk, lax.Precision.HIGHEST if precision is None else precision,
                                    apart)
    return _prep_kernel(backend, dv, q, k, v, g, beta, chunk, rep=rep)


def gdn_chunk_prep_conv(conv, g, beta, chunk: int, *, key_heads: int, key_dim: int, scale: float,
                        precision=None, apart=lambda a: a, impl: str | None = None):
    """`gdn_chunk_prep` from the GDN conv output conv [B, L, 2 HK dk + HV dv] (after its silu; g, beta
    [B, L, HV]): q, k, v are its column groups, q and k l2-normed (fp32) and q multiplied by `scale`, as the model's
    prefill does. With the kernel chosen (op "gdn_chunk_prep", the same choice as `gdn_chunk_prep`) and
    `PrepTiles.in_place` (FNX_GDN_PREP_TILES=in_place=1), the kernel reads them from conv in place and l2-norms
    them itself; otherwise XLA makes q, k and v first and `gdn_chunk_prep` runs as usual."""
    from fnx.pallas.gdn import prep
    bsz, length, width = conv.shape
    hv = g.shape[-1]
    hk, dk = key_heads, key_dim
    dv = (width - 2 * hk * dk) // hv if hv else 0
    if hv % hk or dv <= 0 or 2 * hk * dk + hv * dv != width:
        raise ValueError(f"gdn_chunk_prep_conv: conv's {width} columns are not 2 x {hk} key heads x {dk} + {hv} value "
                         f"heads (g {g.shape})")
    for name, a in (("g", g), ("beta", beta)):
        if a.shape != (bsz, length, hv):
            raise ValueError(f"gdn_chunk_prep_conv: {name} {a.shape} must be {(bsz, length, hv)}")
    t = prep.prep_tiles()
    if t.in_place:
        backend = _chunk_prep_backend(dk, dv, chunk, impl)
        if backend != "reference":
            return _prep_kernel(backend, dv, conv, None, None, g, beta, chunk, rep=hv // hk,
                                conv=prep.ConvInput(hk, dk, float(scale), reference.L2NORM_EPS))
        impl = backend
    q, k, v = jnp.split(conv, [hk * dk, 2 * hk * dk], axis=-1)
    q, k = (reference.l2norm(a.reshape(bsz, length, hk, dk).astype(jnp.float32)) for a in (q, k))
    v = v.reshape(bsz, length, hv, dv).astype(jnp.float32)
    return gdn_chunk_prep(q * scale, k, v, g, beta, chunk, precision=precision, apart=apart, impl=impl,
                          rep=hv // hk)


OP_PREFILL = "gdn_prefill"
CHUNK_SCAN_MAX_DK = 256         # the kernel holds a [dk, BV] fp32 state tile and [C, dk] chunk tiles in registers


def scan_tokens(o, length: int, dtype):
    """The chunk scan's o [B, H, N, C, dv] (fp32) as the model's tokens: the first `length` rows, [B, L, H, dv] in
    `dtype`."""
    bsz, h, n, c, dv = o.shape
    return jnp.moveaxis(o.reshape(bsz, h, n * c, dv)[:, :, :length], 1, 2).astype(dtype)


def gdn_chunk_scan(new_values, k_cumdecay, q, intra, k, chunk_decay, state, impl: str | None = None, *,
                   tiles=None, tokens=None):
    """The sequential pass of the chunked gated delta rule (prefill) over N chunks of C tokens: per chunk
    v_new = nv - kcd S, o = q S + intra v_new, S = S * decay + k^T v_new, in fp32 (`reference.chunk_scan` has the
    shapes). One Pallas launch holds each (sequence, head, value-column block)'s state tile across all chunks,
    where XLA's scan runs several small kernels per chunk. Op name for FNX_KERNELS: "gdn_prefill".
    tokens: (L, dtype) to have o as [B, L, H, dv] in that dtype (the first L of the N * C rows; the model's
    layout), rearranged by XLA or, with `ScanTiles.tokens_out`, stored so by the kernel; None: [B, H, N, C, dv]
    fp32."""
    bsz, h, n, c, dv = new_values.shape
    dk = k.shape[-1]
    want = {"k_cumdecay": (bsz, h, n, c, dk), "q": (bsz, h, n, c, dk), "k": (bsz, h, n, c, dk),
            "intra": (bsz, h, n, c, c), "chunk_decay": (bsz, h, n), "state": (bsz, h, dk, dv)}
    for name, a in (("k_cumdecay", k_cumdecay), ("q", q), ("k", k), ("intra", intra),
                    ("chunk_decay", chunk_decay), ("state", state)):
        if a.shape != want[name] or a.dtype != F32:
            raise ValueError(f"gdn_chunk_scan: {name} {a.shape} {a.dtype} must be fp32 {want[name]}")
    if new_values.dtype != F32:
        raise ValueError(f"gdn_chunk_scan: new_values must be fp32, got {new_values.dtype}")
    why = None
    if not (_is_pow2(dk) and _is_pow2(dv) and _is_pow2(c)) or min(dk, dv, c) < 16 or dk > CHUNK_SCAN_MAX_DK:
        why = (f"the kernel's dots need power-of-two dims of at least 16 (chunk {c}, dk {dk}, dv {dv}) and dk <= "
               f"{CHUNK_SCAN_MAX_DK}")
    if tokens is not None and not 0 < tokens[0] <= n * c:
        raise ValueError(f"gdn_chunk_scan: tokens {tokens[0]} must be in 1..{n * c} ({n} chunks of {c})")
    backend = dispatch.resolve(OP_PREFILL, impl, not_applicable=why)
    rearranged = lambda o: scan_tokens(o, *tokens)      # noqa: E731

    if backend == "reference":
        o, s = reference.chunk_scan(new_values, k_cumdecay, q, intra, k, chunk_decay, state)
        return (o if tokens is None else rearranged(o)), s
    from fnx.pallas.gdn import pallas as kernel
    t = tiles or kernel.scan_tiles(dv)
    stored = tokens is not None and t.tokens_out
    o, s = kernel.chunk_scan(new_values, k_cumdecay, q, intra, k, chunk_decay, state,
                             interpret=dispatch.interpret_flag(backend), tiles=t, tokens=tokens if stored else None)
    return (o if tokens is None or stored else rearranged(o)), s
