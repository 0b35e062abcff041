"""Layer views of stacked weights (fnx/pallas/stacked.py): a kernel given LayerRef(stack, i) reads layer i of the
stack in place and computes exactly what it computes from the layer's own array."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.model import quant
from fnx.pallas import stacked
from fnx.pallas.gemv import api
from fnx.pallas.gemv import pallas as gp
from tests.pallas.kernel_mode import INTERPRET, KERNEL

F32 = jnp.float32
L = 3


def _stack(arrays):
    return jnp.stack(arrays)


def test_layer_ref_is_a_view_until_materialized():
    s = jnp.arange(L * 4 * 6, dtype=F32).reshape(L, 4, 6)
    r = stacked.LayerRef(s, 1)
    assert r.shape == (4, 6) and r.dtype == F32 and r.ndim == 2
    np.testing.assert_array_equal(np.asarray(stacked.materialize(r)), np.asarray(s[1]))
    assert stacked.materialize(s) is s
    assert stacked.astype(r, F32) is r                              # already that dtype: still a view
    b = stacked.astype(r, jnp.bfloat16)
    assert isinstance(b, jax.Array) and b.dtype == jnp.bfloat16 and b.shape == (4, 6)
    f = stacked.flatten(r)
    assert isinstance(f, stacked.LayerRef) and f.shape == (24,) and f.index == 1
    np.testing.assert_array_equal(np.asarray(f.get()), np.asarray(s[1]).reshape(-1))
    for bad in (L, -1):
        with pytest.raises(IndexError, match="outside a stack"):
            stacked.LayerRef(s, bad)
    with pytest.raises(TypeError, match="static"):
        stacked.LayerRef(s, jnp.int32(1))


def _layers(fmt, n, k, key):
    """L layers of one weight kind: the per-layer raw arrays (w, scale, scale_2) and their stacks."""
    per = []
    for i in range(L):
        w = jax.random.normal(jax.random.fold_in(key, i), (n, k), F32) * k ** -0.5
        if fmt == "bf16":
            per.append((w.astype(jnp.bfloat16), None, None))
        elif fmt == "fp8":
            q = quant.quantize_fp8_block(w)
            per.append((q.w, q.scale_inv, None))
        else:
            q = quant.quantize_nvfp4(w)
            per.append((q.w, q.scale, q.scale_2))
    stacks = tuple(None if per[0][j] is None else _stack([p[j] for p in per]) for j in range(3))
    return per, stacks


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:       # a jaxpr Literal
        return False
    return True


def _kernel_reads(jaxpr, stacks):
    """Walk a jaxpr (into nested jits) from the vars `stacks` (name -> var): (the stacks some pallas_call reads in
    place, or through a reshape / convert; the pallas_calls that read a slice of one instead, by kernel name; the
    pallas_calls by kernel name)."""
    read, sliced, calls = set(), {}, {}

    def walk(jx, names):   # names: var -> the stack it is (or is a reshape of)
        made_by = {o: e for e in jx.eqns for o in e.outvars}
        for e in jx.eqns:
            prim = str(e.primitive)
            src = e.invars[0] if e.invars else None
            if prim in ("reshape", "convert_element_type") and _hashable(src) and src in names:
                names[e.outvars[0]] = names[src]
            if "pallas_call" in prim:
                name = str(e.params.get("name_and_src_info") or e.params.get("name")).split(" ")[0]
                calls[name] = calls.get(name, 0) + 1
                for v in filter(_hashable, e.invars):
                    if v in names:
                        read.add(names[v])
                    p = made_by.get(v)
                    if p is not None and str(p.primitive) in ("slice", "dynamic_slice", "squeeze", "gather") \
                            and _hashable(p.invars[0]) and p.invars[0] in names:
                        sliced[name] = sliced.get(name, 0) + 1
                continue
            sub = e.params.get("jaxpr")
            if sub is not None:
                inner = getattr(sub, "jaxpr", sub)
                walk(inner, {iv: names[ov] for ov, iv in zip(e.invars, inner.invars) if _hashable(ov) and ov in names})
    walk(jaxpr, dict(stacks))
    return read, sliced, calls


def _no_slices(fn, *args):
    """fn(*args)'s kernels read the stacks in place: every stack argument in use reaches a pallas_call as it is (or
    through a reshape, a bitcast; through nested jits too), and no pallas_call operand is a slice of one (XLA would
    copy it first). Returns (ok, what was seen)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    top = {v: k for k, (v, a) in enumerate(zip(jaxpr.invars, jax.tree.leaves(args))) if a.ndim and a.shape[0] == L}
    read, sliced, _ = _kernel_reads(jaxpr, top)
    used = {top[v] for e in jaxpr.eqns for v in e.invars if _hashable(v) and v in top}   # (unread fields: not passed)
    return used <= read and not sliced, {"unread stacks": len(used - read), "sliced": sliced}


@pytest.mark.parametrize("fmt,mode", [("bf16", None), ("fp8", None), ("fp8", "fma"), ("nvfp4", None)])
def test_gemv_reads_a_layer_of_the_stack_in_place(fmt, mode):
    n, k = 128, 2048
    key = jax.random.PRNGKey(int(np.random.SeedSequence().entropy % 2**31))
    per, (ws, ss, s2s) = _layers(fmt, n, k, key)
    x = jax.random.normal(jax.random.fold_in(key, 99), (2, k), F32).astype(jnp.bfloat16)
    t = api.heuristic_tiles(fmt, n, k, 1 if mode == "fma" else 2)
    if mode == "fma":
        assert t.mode == "fma"
        x = x[:1]
    for i in range(L):
        w, s, s2 = per[i]
        want = gp.gemv(x, w, s, s2, fmt=fmt, tiles=t, interpret=INTERPRET)
        view = lambda st: None if st is None else stacked.LayerRef(st, i)   # noqa: E731

        def run(x, ws, ss, s2s):
            return gp.gemv(x, view(ws), view(ss), view(s2s), fmt=fmt, tiles=t, interpret=INTERPRET)
        got = jax.jit(run)(x, ws, ss, s2s)
        np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))
        ok, eqns = _no_slices(run, x, ws, ss, s2s)
        assert ok, eqns


def test_pair_reads_layers_of_the_stacks_in_place():
    k, n1, n2 = 2048, 256, 96
    key = jax.random.PRNGKey(5)
    per1, (w1s, s1s, _) = _layers("fp8", n1, k, key)
    per2, (w2s, _, _) = _layers("bf16", n2, k, jax.random.fold_in(key, 7))
    x = jax.random.normal(jax.random.fold_in(key, 8), (1, k), F32).astype(jnp.bfloat16)
    t = api.tiles_for("fp8", n1, k, 1)
    assert t.mode != "loop"
    for i in range(L):
        want = gp.gemv_pair(x, per1[i][0], per1[i][1], per2[i][0], tiles=t, interpret=INTERPRET)

        def run(x, w1s, s1s, w2s):
            return gp.gemv_pair(x, stacked.LayerRef(w1s, i), stacked.LayerRef(s1s, i), stacked.LayerRef(w2s, i),
                                tiles=t, interpret=INTERPRET)
        got = jax.jit(run)(x, w1s, s1s, w2s)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, F32), np.asarray(w, F32))
        ok, eqns = _no_slices(run, x, w1s, s1s, w2s)
        assert ok, eqns


def test_pair_many_reads_layers_of_the_stacks_in_place():
    """The several-token pair (five tokens, split-K tiles) on layer views: the same bits as on per-layer arrays,
    and no slice of a stack before the launch."""
    k, n1, n2 = 1024, 256, 96
    key = jax.random.PRNGKey(6)
    per1, (w1s, s1s, _) = _layers("fp8", n1, k, key)
    per2, (w2s, _, _) = _layers("bf16", n2, k, jax.random.fold_in(key, 7))
    x = jax.random.normal(jax.random.fold_in(key, 8), (5, k), F32).astype(jnp.bfloat16)
    t = gp.Tiles(64, 128, 2)
    for i in range(L):
        want = gp.gemv_pair_many(x, per1[i][0], per1[i][1], per2[i][0], tiles=t, interpret=INTERPRET)

        def run(x, w1s, s1s, w2s):
            return gp.gemv_pair_many(x, stacked.LayerRef(w1s, i), stacked.LayerRef(s1s, i),
                                     stacked.LayerRef(w2s, i), tiles=t, interpret=INTERPRET)
        got = jax.jit(run)(x, w1s, s1s, w2s)
        np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))
        ok, eqns = _no_slices(run, x, w1s, s1s, w2s)
        assert ok, eqns


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "bf16"])
def test_stacked_gemv_lowers_for_cuda_at_released_shapes(fmt):
    """The GDN out_proj (2560 x 6144) of 36 stacked layers, layer 17, at one token: one Triton call on the
    stacks."""
    n, k, layers = 2560, 6144, 36
    S = jax.ShapeDtypeStruct
    t = api.tiles_for(fmt, n, k, 1)
    if fmt == "fp8":
        args = (S((layers, n, k), jnp.float8_e4m3fn), S((layers, n // 128, k // 128), F32), None)
    elif fmt == "nvfp4":
        args = (S((layers, n, k // 2), jnp.uint8), S((layers, n, k // 16), jnp.float8_e4m3fn), S((layers, n), F32))
    else:
        args = (S((layers, n, k), jnp.bfloat16), None, None)

    def run(x, w, s, s2):
        view = lambda a: None if a is None else stacked.LayerRef(a, 17)   # noqa: E731
        return gp.gemv(x, view(w), view(s), view(s2), fmt=fmt, tiles=t)
    text = jax.jit(run).trace(S((1, k), jnp.bfloat16), *args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "fnx_gemv" in text


@pytest.mark.parametrize("m,fp8", [(1, False), (1, True), (3, True)])
def test_hc_boundary_reads_layers_of_the_stacks_in_place(m, fp8):
    """The one- and few-token HC kernels given layer views of stacked Wdown / Wup (their FP8 block scales), norm and
    Winj: the layer's own arrays' bits, and no slice of a stack in the program."""
    from fnx.pallas.hc import api as hc
    from fnx.pallas.hc import pallas as hk
    from tests.pallas.test_hc import _fp8, _inputs
    s, d, r = 4, 320, 40
    layers = [_inputs((1, m), s, d, r, jnp.bfloat16, 100 + i) for i in range(L)]
    h, y, inj, _ = layers[0]
    names = ("hc_norm", "input_mix_weight_down", "input_mix_weight_up", "block_inject_weight")
    per = []
    for _, _, _, p in layers:
        if fp8:
            q = _fp8(p)
            down, up = q["input_mix_weight_down"], q["input_mix_weight_up"]
            per.append((p["hc_norm"], down.w, up.w, p["block_inject_weight"], down.scale_inv, up.scale_inv))
        else:
            per.append((*(p[k] for k in names), None, None))
    stacks = tuple(None if per[0][j] is None else _stack([q[j] for q in per]) for j in range(6))
    tiles = hk.Tiles1(bn=2, bd=16)

    def run(h, y, inj, ws, i):
        v = [None if a is None else stacked.LayerRef(a, i) for a in ws]
        return hc.hc_boundary(h, y, inj, *v[:4], streams=s, eps=1e-6, impl=KERNEL, tiles=tiles,
                              w_down_scale=v[4], w_up_scale=v[5])
    for i in (L - 1,):      # a nonzero offset into the stacks (the interpreter is slow: one layer)
        want = hc.hc_boundary(h, y, inj, *per[i][:4], streams=s, eps=1e-6, impl=KERNEL, tiles=tiles,
                              w_down_scale=per[i][4], w_up_scale=per[i][5])
        got = jax.jit(run, static_argnums=4)(h, y, inj, stacks, i)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, F32), np.asarray(w, F32))
        ok, eqns = _no_slices(lambda h, y, inj, ws: run(h, y, inj, ws, i), h, y, inj, stacks)
        assert ok, eqns


@pytest.mark.parametrize("bv,impl", [(None, "kernel"), (4, "kernel"), (None, "reference")])
def test_gdn_step_reads_layers_of_the_stacks_in_place(bv, impl):
    """The GDN decode core given layer views of stacked conv_w, A_log, dt_bias and the norm weight (per-head and
    per-column blocks composed with the layer): the layer's own arrays' bits; the reference slices them."""
    from fnx.pallas.gdn import api as gdn
    from fnx.pallas.gdn.pallas import StepTiles
    from tests.pallas.test_gdn import step_inputs
    names = ("conv_w", "a_log", "dt_bias", "norm_w")
    per = [step_inputs(jax.random.PRNGKey(40 + i)) for i in range(L)]
    base = per[0]
    stacks = {k: _stack([p[k] for p in per]) for k in names}
    tiles = None if bv is None else StepTiles(block_v=bv, num_warps=4)
    impl = KERNEL if impl == "kernel" else impl

    def run(d, st, i):
        views = {k: stacked.LayerRef(st[k], i) for k in names}
        return gdn.gdn_step(**dict(d, **views), impl=impl, key_heads=2, eps=1e-6, act="sigmoid",
                            tiles=tiles if impl != "reference" else None)
    for i in range(L):
        d = dict(base, **{k: per[i][k] for k in names})
        want = jax.jit(lambda d: gdn.gdn_step(**d, impl=impl, key_heads=2, eps=1e-6, act="sigmoid",
                                              tiles=tiles if impl != "reference" else None))(d)
        got = jax.jit(run, static_argnums=2)(base, stacks, i)
        for g, w in zip(got, want):
            if impl != "reference" and bv is None:      # all in the kernel: the same bits
                np.testing.assert_array_equal(np.asarray(g, F32), np.asarray(w, F32))
            else:   # XLA ops around a slice may fuse differently: fp32 ulps
                np.testing.assert_allclose(np.asarray(g, F32), np.asarray(w, F32), rtol=1e-6, atol=1e-6)
        if impl != "reference":
            ok, eqns = _no_slices(lambda d, st: run(d, st, i), base, stacks)
            assert ok, eqns


@pytest.mark.parametrize("fmt,m,group", [("nvfp4", 1, 1), ("fp8", 3, 0)])
def test_moe_decode_reads_layers_of_the_stacked_experts_in_place(fmt, m, group):
    """The fused MoE decode kernels given the routed experts (every quantized field) and the shared expert's down
    projection as layer views: the layer's own arrays' bits, and no slice of a stack in the program; the
    reference path slices them."""
    import dataclasses

    from fnx.pallas.moe import api as moe
    from tests.pallas.test_moe import DT, _decode_args
    per = [_decode_args(fmt, m, 50 + i) for i in range(L)]
    act = per[0][:3] + per[0][5:8]            # x, w, ids; s_gate, s_up, s_sig of layer 0 (activations)
    weights = [(p[3], p[4], p[8]) for p in per]
    stacks = jax.tree.map(lambda *a: jnp.stack(a), *weights)
    tiles = dataclasses.replace(DT, group=group, e2m1="f16" if fmt == "nvfp4" else "int")

    def run(act, st, i, impl=KERNEL):
        gu, dn, sd = jax.tree.map(lambda a: stacked.LayerRef(a, i), st)
        x, w, ids, sg, su, ss = act
        return moe.decode(x, w, ids, gu, dn, sg, su, ss, sd, impl=impl, tiles=tiles)
    for i in (L - 1,):      # a nonzero offset into the stacks (the interpreter is slow: one layer)
        x, w, ids, sg, su, ss = act
        want = jax.jit(lambda: moe.decode(x, w, ids, *weights[i][:2], sg, su, ss, weights[i][2], impl=KERNEL,
                                          tiles=tiles))()
        got = jax.jit(run, static_argnums=2)(act, stacks, i)
        np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))
        ok, seen = _no_slices(lambda a, st: run(a, st, i), act, stacks)
        assert ok, seen
    ref = jax.jit(run, static_argnums=(2, 3))(act, stacks, 1, "reference")
    want = jax.jit(lambda: moe.decode(*act[:3], *weights[1][:2], *act[3:], weights[1][2], impl="reference"))()
    # XLA's reference path: a slice fused into a dot can change the dot's code (its summation order), and the bf16
    # output then differs: by up to one bf16 ulp on the H200 (0f73286) and one CI machine's CPU (516d270), where
    # other CPUs gave the same bits; and once (a fresh-clone run at d3ccb94's tree) by 2.4e-4 on an element of
    # -0.0098, where an intermediate bf16 rounding (gate / up, the act) fell the other way and carried into the down
    # product. So: within one bf16 ulp of the output's largest magnitude (~1.2 here), element by element.
    r, wv = np.asarray(ref, F32), np.asarray(want, F32)
    big = np.maximum(np.abs(r).max(), np.abs(wv).max())
    ulp = np.exp2(np.floor(np.log2(max(big, 2.0 ** -126))) - 7)    # bf16: 8 significant bits
    over = np.abs(r - wv) > ulp
    assert not over.any(), (np.argwhere(over)[:5], r[over][:5], wv[over][:5])


@pytest.mark.parametrize("tokens", [1, 5])
def test_whole_step_reads_every_stack_in_place(tokens, monkeypatch):
    """The 12-layer tiny model (two stacked groups) with `unroll_stacked`, FP8 dense and NVFP4 experts, fused
    projections, every kernel named (interpret mode): its decode step (1 token) and verify window (5) pass the
    stacks to the kernels whole, never a slice of one; the stacked layout takes far fewer argument arrays."""
    from functools import partial

    from fnx.model.fuse import fuse_projections
    from fnx.model.transformer import init_state, param_shapes, step
    from tests.conftest import load_script
    monkeypatch.setenv("FNX_KERNELS", "pallas_interpret")
    bd = load_script("bench_decode")
    counts = {}
    for stack in (False, True):
        cfg = bd.bench_config(12, True, scan=stack).replace(unroll_stacked=stack)
        p = bd.random_tree(param_shapes(cfg, jnp.bfloat16), jax.random.PRNGKey(0), jnp.bfloat16)
        counts[stack] = p = fuse_projections(cfg, bd.quantize_tree(p, "fp8+nvfp4"))
    cfg = bd.bench_config(12, True, scan=True).replace(unroll_stacked=True)
    st = init_state(cfg, 1, 256, jnp.bfloat16)
    tok = jnp.ones((1, tokens), jnp.int32)
    pid = jnp.zeros((1, tokens, cfg.ngram_heads), jnp.int32) if cfg.ple_layer_ids else None
    jaxpr = jax.make_jaxpr(partial(step, cfg=cfg))(p, st, tok, pid).jaxpr
    leaves = jax.tree.leaves(p)
    stacks = {v: v for v, a in zip(jaxpr.invars, leaves) if a.ndim and a.shape[0] == 2}     # reps = 2 groups
    read, sliced, calls = _kernel_reads(jaxpr, stacks)
    assert not sliced, sliced
    assert len(read) > 0.75 * len(stacks), (len(read), len(stacks))     # the rest: norms and gates, XLA's
    for kernel in ("fnx_gemv_fp8", "moe_decode_gate_up", "moe_decode_down", "qsa_decode_attention", "qsa_prep"):
        assert calls.get(kernel), calls
    assert any(k.startswith("hc_down1_fp8" if tokens == 1 else "hc_down_few_fp8") for k in calls), calls
    # 12 layers: 324 argument arrays stacked against 478 unrolled (48 layers: 324 against 1,864)
    assert len(leaves) < 0.7 * len(jax.tree.leaves(counts[False])), (len(leaves), len(jax.tree.leaves(counts[False])))


@pytest.mark.parametrize("fuse", [True, False])
def test_gdn_recurrent_norm_weight_from_a_stack(fuse):
    """The verify window's recurrence with the GDN output norm fused into the kernel (or after it, in XLA): a layer
    view of the stacked norm weight gives the layer's own array's result."""
    from fnx.pallas.gdn import api as gdn
    from fnx.pallas.gdn.pallas import Tiles
    from tests.pallas.test_gdn import DV, KW, TILES, inputs
    q, k, v, g, beta, s0 = inputs(jax.random.PRNGKey(3), 3, dtype=F32)
    z = jax.random.normal(jax.random.PRNGKey(4), v.shape, F32)
    ws = 1.0 + 0.1 * jax.random.normal(jax.random.PRNGKey(5), (L, DV))
    tiles = Tiles(block_v=DV, fuse_norm=True) if fuse else TILES

    def run(ws, norm_w):
        return gdn.gdn_recurrent(q, k, v, g, beta, s0, impl=KERNEL, out_dtype=F32, tiles=tiles,
                                 norm=(z, norm_w, 1e-6, "silu"), **KW)
    want = jax.jit(lambda w: run(None, w))(ws[L - 1])
    got = jax.jit(lambda st: run(st, stacked.LayerRef(st, L - 1)))(ws)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    if fuse:
        ok, seen = _no_slices(lambda st: run(st, stacked.LayerRef(st, L - 1)), ws)
        assert ok, seen
