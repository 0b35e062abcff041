"""The one-token hyper-connection boundary in one launch (fnx/pallas/hc/one.py): its tasks are the two one-token
kernels' own code, so its results equal `hc_boundary_m1`'s bit for bit, in one launch (one program under the
interpreter, the barrier's atomic included) and split into two launches over several programs (the task loops'
split, the last round's masked tasks); the model's wiring (op "hc_boundary_one", the counter made once per
program); the CUDA lowering with the barrier's polling loop."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.model import hyper, quant
from fnx.pallas import dispatch, grid_sync
from fnx.pallas.hc import api, one
from fnx.pallas.hc import pallas as kernel
from tests.pallas.kernel_mode import INTERPRET, KERNEL, ops_outside_kernels  # noqa: F401
from tests.pallas.test_hc import _args, _inputs


def _fp8_args(p, inject):
    wd = quant.quantize_fp8_block(p["input_mix_weight_down"].astype(jnp.float32))
    wu = quant.quantize_fp8_block(p["input_mix_weight_up"].astype(jnp.float32))
    return (p["hc_norm"], wd.w, wu.w, p["block_inject_weight"] if inject else None), \
        {"w_down_scale": wd.scale_inv, "w_up_scale": wu.scale_inv}


def _same(got, want):
    for g, w, what in zip(got, want, ("H'", "x", "inj")):
        if w is None:
            assert g is None, what
            continue
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert g.shape == w.shape and np.all(np.isfinite(g)), what
        np.testing.assert_array_equal(g, w, err_msg=what)


CASES = [  # dtype, fp8 weights, with y (the combine), inject, m1 tiles
    (jnp.bfloat16, True, True, True, None),
    (jnp.float32, False, True, True, kernel.Tiles1(bn=2, bd=16, fold=0, early=0)),
    (jnp.bfloat16, False, False, True, kernel.Tiles1(bn=4, bd=32)),
    (jnp.bfloat16, True, True, False, kernel.Tiles1(bn=1, bd=16, pieces=False)),
]


@pytest.mark.parametrize("dtype,fp8,with_y,inject,t1", CASES)
@pytest.mark.parametrize("launches,programs", [(1, 1), (2, 3), (2, 7)])
def test_one_launch_equals_the_two_kernels(dtype, fp8, with_y, inject, t1, launches, programs):
    if launches == 1 and not INTERPRET:
        programs = 0                # on a GPU: the default count, two per SM (the barrier waits for them all)
    d, r = (256, 32) if fp8 else (320, 40)      # FP8: whole 128-blocks; dense: non-power-of-two D and r (pieces)
    h, y, inj, p = _inputs((1, 1), 4, d, r, dtype, np.random.randint(1 << 30), inject)
    y, inj = (y, inj) if with_y else (None, None)
    if fp8:
        args, scales = _fp8_args(p, inject)
    else:
        args, scales = _args(p, inject), {}
    want = kernel.hc_boundary_m1(h, y, inj, *args, streams=4, eps=1e-6, interpret=INTERPRET, tiles=t1, **scales)
    got = one.hc_boundary_one(h, y, inj, *args, streams=4, eps=1e-6, interpret=INTERPRET, tiles1=t1,
                              tiles=one.TilesOne(programs=programs), launches=launches, **scales)
    _same(got, want)


def test_one_launch_counts_programs_and_refuses_what_cannot_run(monkeypatch):
    """Under the interpreter one launch has one program (more would wait forever at the barrier): named counts
    raise, saying so; the default picks one. On a GPU the default is two programs per SM, at most the down tasks;
    a named count may take five per SM, and more raises (they could not all be resident for the barrier)."""
    assert one.resolve_programs(one.TilesOne(), 648, interpret=True, launches=1) == 1
    with pytest.raises(ValueError, match="one after another"):
        one.resolve_programs(one.TilesOne(programs=4), 648, interpret=True, launches=1)
    assert one.resolve_programs(one.TilesOne(programs=4), 648, interpret=True, launches=2) == 4
    monkeypatch.setattr(one, "sm_count", lambda: 132)
    assert one.resolve_programs(one.TilesOne(), 648, interpret=False, launches=1) == 264
    assert one.resolve_programs(one.TilesOne(), 100, interpret=False, launches=1) == 100
    assert one.resolve_programs(one.TilesOne(programs=660), 648, interpret=False, launches=1) == 660
    with pytest.raises(ValueError, match="resident at once"):
        one.resolve_programs(one.TilesOne(programs=661), 648, interpret=False, launches=1)
    with pytest.raises(ValueError, match="^hc_boundary_one: programs=-1"):
        one.resolve_programs(one.TilesOne(programs=-1), 648, interpret=False, launches=1)
    with pytest.raises(ValueError, match="^hc_boundary_few_one: programs=661"):   # the errors name the caller's op
        one.resolve_programs(one.TilesOne(programs=661), 160, False, 1, "hc_boundary_few_one")
    monkeypatch.setenv(one.TILES_ENV, "programs=64,max_polls=1000")
    assert one.choose_tiles() == one.TilesOne(programs=64, max_polls=1000)
    monkeypatch.setenv(one.TILES_ENV, "program=64")
    with pytest.raises(ValueError, match="not field=value"):
        one.choose_tiles()


def test_model_boundary_through_one_launch(monkeypatch):
    """FNX_KERNELS=hc_boundary_one=<kernel> routes the model's one-token boundaries through one launch each, with
    the counter taken from the program's pool (no counter launch of its own): the same values as the two kernels."""
    h, y, inj, p = _inputs((1, 1), 4, 256, 32, jnp.bfloat16, np.random.randint(1 << 30))
    monkeypatch.setenv("FNX_KERNELS", KERNEL)          # one backend for every op: the two kernels, as before
    assert api.choose(None, None, tokens=1)[0] == api.OP_M1
    monkeypatch.delenv("FNX_KERNELS")
    with dispatch.force(KERNEL):                         # likewise
        assert api.choose(None, None, tokens=1)[0] == api.OP_M1 and api.choose(None, None, tokens=5)[0] == api.OP_FEW
    monkeypatch.setenv("FNX_KERNELS", f"hc_boundary_one={KERNEL}")
    assert api.choose(None, None, tokens=1) == (api.OP_ONE, KERNEL)
    assert api.choose(KERNEL, None, tokens=1)[0] == api.OP_M1                # an impl names the two kernels' op
    assert api.choose(None, None, tokens=5)[0] != api.OP_ONE
    monkeypatch.setenv("FNX_KERNELS", f"hc_boundary_few_one={KERNEL}")
    assert api.choose(None, None, tokens=5) == (api.OP_FEW_ONE, KERNEL) and api.choose(None, None, 9)[0] == api.OP
    monkeypatch.setenv("FNX_KERNELS", f"hc_boundary_one={KERNEL}")
    def run(h, y, inj):         # the counter from the program's pool (the model's, per decode program)
        with grid_sync.counter_pool(grid_sync.CounterPool(jnp.zeros((8,), jnp.int32))):
            return hyper.boundary(p, h, y, inj, 4, 1e-6)
    jaxpr = jax.make_jaxpr(run)(h, y, inj)
    names = _pallas_names(jaxpr.jaxpr)
    assert names == ["hc_boundary1"], names
    got = jax.jit(run)(h, y, inj)
    monkeypatch.setenv("FNX_KERNELS", f"hc_boundary_m1={KERNEL}")
    want = jax.jit(lambda h, y, inj: hyper.boundary(p, h, y, inj, 4, 1e-6))(h, y, inj)
    _same(got, want)
    assert "hc_boundary_one" in dispatch.KNOWN_OPS and "hc_boundary_one" in dispatch.AUTO_KEEPS_REFERENCE


@pytest.mark.parametrize("m", [1, 5])
def test_one_launch_lowers_for_cuda_released_shapes(m):
    """The released widths (4 x 2560, rank 320, FP8 Wdown / Wup, Winj) in one launch of 264 programs, at one token
    and five: the Triton lowering holds the barrier's polling loop (an scf.while with a volatile load) and its
    acquire-release atomics."""
    from jax._src.lib.mlir import ir  # noqa: F401
    import sys
    import os
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    import sass_count as sc
    tiles = one.TilesOne(programs=264) if m == 1 else one.TilesFewOne(programs=264)
    kernels = sc.hc_one_kernels("fp8", tiles, m)
    assert [k[0] for k in kernels] == ["hc_boundary1_fp8" if m == 1 else "hc_boundary_few1_fp8"]
    text = kernels[0][3]
    assert "scf.while" in text and "tt.atomic_rmw add, acq_rel, gpu" in text
    assert text.count("gpu.barrier") >= 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.conftest import load_script
    tiny = load_script("make_tiny_checkpoint")
    return tiny.write_checkpoint(tmp_path_factory.mktemp("hc_one") / "tiny-a", "tiny-a", seed=0)


def _pallas_names(jaxpr) -> list[str]:
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            out.append(str(e.params["name"]))
            continue
        for p in e.params.values():
            inner = getattr(p, "jaxpr", None)
            if inner is not None:
                out += _pallas_names(getattr(inner, "jaxpr", inner))
    return out


@pytest.mark.parametrize("layers", ["scanned", "stacked"])
def test_model_decode_step_with_one_launch_boundaries(tiny_dir, monkeypatch, layers):
    """The tiny model's one-token step with its boundaries in one launch each: the same logits as with the two
    kernels (their task code), one counter launch for the whole step, one launch per boundary; under lax.scan and
    with every layer reading its weights in place in the stacks (the layout served on a GPU)."""
    import fnx
    from fnx.model import transformer
    model = fnx.load(tiny_dir, dtype=jnp.bfloat16, layers=layers)
    cfg = model.cfg
    from fnx.ple import initial_context, ngram_ids
    toks = np.asarray([[7]], np.int32)
    ids = jnp.asarray(toks)
    ple = None if model.ngram is None else jnp.asarray(
        ngram_ids(initial_context(1, model.ngram), toks, model.ngram)[0], jnp.int32)

    def step(params, state):
        return transformer.step(params, state, ids, ple, cfg=cfg)[0]
    runs = {}
    for op in ("hc_boundary_m1", "hc_boundary_one"):
        monkeypatch.setenv("FNX_KERNELS", f"{op}={KERNEL}")
        jax.clear_caches()
        state = fnx.new_state(model, 1, 8)
        names = _pallas_names(jax.make_jaxpr(step)(model.params, state).jaxpr)
        runs[op] = (np.asarray(jax.jit(step)(model.params, state), np.float32), names)
    (want, two), (got, one_) = runs["hc_boundary_m1"], runs["hc_boundary_one"]
    np.testing.assert_array_equal(got, want)
    boundaries = sum(n.startswith("hc_down1") for n in two)
    assert boundaries >= 2 * cfg.num_hidden_layers and sum(n.startswith("hc_up1") for n in two) == boundaries
    assert sum(n.startswith("hc_boundary1") for n in one_) == boundaries
    assert one_.count("fnx_grid_sync_init") == 1 and not any(n.startswith("hc_down1") for n in one_)


FEW_CASES = [  # tokens, dtype, fp8 weights, with y, inject
    (5, jnp.float32, True, True, True),
    (2, jnp.float32, False, True, True),
    (5, jnp.bfloat16, True, True, True),
    (8, jnp.bfloat16, False, False, True),
    (3, jnp.bfloat16, True, True, False),
]


@pytest.mark.parametrize("m,dtype,fp8,with_y,inject", FEW_CASES)
@pytest.mark.parametrize("launches,programs,kc", [(1, 1, 1), (3, 3, 1), (3, 7, 2), (1, 1, 4)])
def test_few_tokens_one_launch_matches_reference(m, dtype, fp8, with_y, inject, launches, programs, kc):
    """2..8 tokens in one launch: the tensor-core down tasks over splits of kc chunks of each stream, the mid tasks
    (each stream's splits summed times each token's 1/rms: the one-token kernels' `fold`; the streams summed, silu)
    and the tensor-core up tasks with the mix, against the reference: fp32 to 1e-5 (only the order of sums and where the 1/rms multiplies differ), bf16
    within the HC tests' tolerance, H' bit for bit. Three launches over 3 or 7 programs: the task loops' split, the
    last round's masked tasks (on a GPU too: the barriers' phases as launches)."""
    from tests.pallas.test_hc import _check_few
    if launches == 1 and not INTERPRET:
        programs = 0
    d, r = 256, (24 if m == 2 else 32)     # r = 24: the up MMA's K pieces 16 + 16, 8 masked
    h, y, inj, p = _inputs((1, m), 4, d, r, dtype, np.random.randint(1 << 30), inject)
    y, inj = (y, inj) if with_y else (None, None)
    if fp8:
        args, scales = _fp8_args(p, inject)
        wd = quant.dequantize(quant.Fp8Block(args[1], scales["w_down_scale"], (128, 128)), dtype)
        wu = quant.dequantize(quant.Fp8Block(args[2], scales["w_up_scale"], (128, 128)), dtype)
        ref_args = (args[0], wd, wu, args[3])
    else:
        args, scales = _args(p, inject), {}
        ref_args = args
    from fnx.pallas.hc import reference
    want = reference.hc_boundary(h, y, inj, *ref_args, streams=4, eps=1e-6)
    got = one.hc_boundary_one_few(h, y, inj, *args, streams=4, eps=1e-6, interpret=INTERPRET, launches=launches,
                                  tiles=one.TilesFewOne(bn=16, bk=64 // kc if kc > 1 else 64, kc=kc, bm=8 << (m % 2),
                                                        bd=16 << (m % 2), programs=programs),
                                  **scales)
    _check_few(got, want, dtype)


def test_few_tokens_one_launch_refuses_tiles_that_do_not_fit():
    assert one.check_few(4, 2560, 320, one.TilesFewOne()) is None
    assert "bn=24" in one.check_few(4, 2560, 320, one.TilesFewOne(bn=24))
    assert one.check_few(4, 32, 16, one.TilesFewOne(bk=32)) is None     # r < bn: the rows past r masked
    assert one.check_few(4, 2560, 40, one.TilesFewOne()) is None         # the up MMA's K: 32 + 16 (8 masked)
    assert "bk=256" in one.check_few(4, 2560, 320, one.TilesFewOne(bk=256))
    assert "bd=3" in one.check_few(4, 2560, 320, one.TilesFewOne(bd=3))
    assert "bd=8" in one.check_few(4, 2560, 320, one.TilesFewOne(bd=8))
    assert "S=3" in one.check_few(3, 2560, 320, one.TilesFewOne())
    assert one.check_few(4, 2560, 320, one.TilesFewOne(kc=4)) is None                 # 20 chunks in 5 splits
    assert "kc=3" in one.check_few(4, 2560, 320, one.TilesFewOne(kc=3))
    assert "bm=4" in one.check_few(4, 2560, 320, one.TilesFewOne(bm=4))
    assert one.few_tasks(4, 2560, 320, one.TilesFewOne()) == (480, 41, 160)       # (5 + 1) x 4 x 20, 324 / 8, 2560 / 16
    h, y, inj, p = _inputs((1, 5), 4, 256, 32, jnp.bfloat16, 0)
    with pytest.raises(ValueError, match="bn=8: a power of two in 16..128"):
        one.hc_boundary_one_few(h, y, inj, *_args(p, True), streams=4, eps=1e-6, interpret=True,
                                tiles=one.TilesFewOne(bn=8))
    assert one.few_tiles(2560, 320).bk == 128 and one.few_tiles(96, 8).bk == 32
    # split: the three phases as three launches (P = 3), the same values as one launch (P = 1 under the
    # interpreter, the default on a GPU)
    got = one.hc_boundary_one_few(h, y, inj, *_args(p, True), streams=4, eps=1e-6, interpret=INTERPRET,
                                  tiles=one.TilesFewOne(bk=64, split=1, programs=3))
    want = one.hc_boundary_one_few(h, y, inj, *_args(p, True), streams=4, eps=1e-6, interpret=INTERPRET,
                                   tiles=one.TilesFewOne(bk=64, programs=1 if INTERPRET else 0))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_model_verify_window_with_one_launch_boundaries(tiny_dir, monkeypatch):
    """The tiny model's five-token call (an MTP verify window's shape, with rollback snapshots) with every boundary in
    one launch (op "hc_boundary_few_one"): one counter launch, one launch per boundary, logits within bf16 noise of
    the reference boundaries (the 1/rms multiplies each down row's sum, not Hn: not the reference's bits)."""
    import fnx
    from fnx.model import transformer
    from fnx.ple import initial_context, ngram_ids
    model = fnx.load(tiny_dir, dtype=jnp.bfloat16)
    cfg = model.cfg
    toks = np.asarray([[7, 3, 11, 5, 2]], np.int32)
    ple = None if model.ngram is None else jnp.asarray(
        ngram_ids(initial_context(1, model.ngram), toks, model.ngram)[0], jnp.int32)

    def step(params, state):
        return transformer.step(params, state, jnp.asarray(toks), ple, cfg=cfg, snapshots=True)[0]
    runs = {}
    for spec in ("reference", f"hc_boundary_few_one={KERNEL}"):
        monkeypatch.setenv("FNX_KERNELS", spec)
        jax.clear_caches()
        state = fnx.new_state(model, 1, 16)
        names = _pallas_names(jax.make_jaxpr(step)(model.params, state).jaxpr)
        runs[spec] = (np.asarray(jax.jit(step)(model.params, state), np.float32), names)
    (want, none), (got, names) = runs["reference"], runs[f"hc_boundary_few_one={KERNEL}"]
    assert none == []
    assert names.count("fnx_grid_sync_init") == 1
    assert sum(n.startswith("hc_boundary_few1") for n in names) >= 2 * cfg.num_hidden_layers
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.all(np.isfinite(got)) and err < 3e-2, err
