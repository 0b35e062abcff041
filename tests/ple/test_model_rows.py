"""Rows from every store mode against the model's own in-params table, and a forward through the step."""

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnx
from fnx.model import ple as model_ple
from fnx.model.transformer import init_state, step
from fnx.ple import context_after, initial_context, ngram_ids
from fnx.ple.pipeline import PrefetchPipeline, fetch_rows_in_graph
from fnx.ple.store import MODES, open_store
from tests.conftest import load_script
from tests.ple.test_ring import slow_host


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("torch")
    path = load_script("make_tiny_checkpoint").write_checkpoint(
        tmp_path_factory.mktemp("ple_model") / "tiny-a", "tiny-a", seed=0, dtype="bfloat16")
    return fnx.load(path, dtype=jnp.bfloat16)


@partial(jax.jit, static_argnames=("cfg",))
def _step(params, state, tokens, ple_ids, ple_rows, cfg):
    return step(params, state, tokens, ple_ids, cfg=cfg, ple_rows=ple_rows)


def _tokens(model, batch, length, seed):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, model.cfg.vocab_size, (batch, length))
    t[rng.random(t.shape) < 0.15] = model.cfg.ple_eos_token_id
    return t


def test_every_mode_matches_the_params_table(tiny):
    table = tiny.params["segments"]
    layer = tiny.cfg.ple_layers[0]
    ids, _ = ngram_ids(initial_context(2, tiny.ngram), _tokens(tiny, 2, 11, 0), tiny.ngram)
    ids = ids.astype(np.int32)
    seg_table = _params_table(tiny)
    want = np.asarray(model_ple.gather_rows(seg_table, jnp.asarray(ids)))
    assert layer == 1 and table
    for mode in MODES:
        with open_store(tiny.path, mode) as store:  # cfg and layer come from the checkpoint's config.json
            assert store.src.rows == seg_table.shape[0]
            got = store.rows(ids.reshape(-1, ids.shape[-1])).reshape(want.shape)
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=mode)


def _params_table(model):
    from fnx.model.transformer import layer_plan
    layer = model.cfg.ple_layers[0]
    for seg, p in zip(layer_plan(model.cfg), model.params["segments"]):
        if not seg.scanned and seg.start == layer:
            return p[0]["ple"]["ple_embedding"]["ngram_embedding"]
    raise AssertionError("no unscanned PLE layer")


def test_step_with_store_rows_equals_step_with_ids(tiny):
    """Prefill, then MTP-like verify windows with rollback: rows from the pipeline (pageable store) and from an
    in-graph io_callback give the same logits as the params-table gather."""
    cfg, consts = tiny.cfg, tiny.ngram
    batch = 2
    store = open_store(tiny.path, "pageable")
    pipe = PrefetchPipeline(store)
    ctx = initial_context(batch, consts)
    s_ids = init_state(cfg, batch, 64, tiny.dtype)
    s_rows = init_state(cfg, batch, 64, tiny.dtype)
    prompt = _tokens(tiny, batch, 9, 1)
    pipe.hint_prompt(ctx, prompt)
    for r, window in enumerate([prompt] + [_tokens(tiny, batch, 4, 10 + i) for i in range(3)]):
        ticket = pipe.submit_tokens(ctx, window)
        ids, _ = ngram_ids(ctx, window, consts)
        got = pipe.take(ticket)
        assert not got.flagged.any() and got.error is None
        toks = jnp.asarray(window, jnp.int32)
        lg_ids, s_ids_new = _step(tiny.params, s_ids, toks, jnp.asarray(ids, jnp.int32), None, cfg)[:2]
        lg_rows, s_rows_new = _step(tiny.params, s_rows, toks, None, got.rows, cfg)[:2]
        np.testing.assert_array_equal(np.asarray(lg_rows), np.asarray(lg_ids))
        if r == 1:  # the in-graph host callback gives the same rows
            f = jax.jit(lambda i: fetch_rows_in_graph(store, i, "io"))
            np.testing.assert_array_equal(np.asarray(f(jnp.asarray(ids, jnp.int32))).view(np.uint16),
                                          np.asarray(got.rows).view(np.uint16))
        # Keep the whole window, as the step's state did (rolling back model state is the engine's job).
        np.testing.assert_array_equal(got.new_context, context_after(ctx, window, window.shape[1], consts))
        ctx = got.new_context
        s_ids, s_rows = s_ids_new, s_rows_new
    pipe.close()
    assert store.stats["fetches"] >= 4 and store.stats["prefetch_calls"] >= 1
    store.close()


# ---- the engine with the table in a host store ----------------------------------------------------------------

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 1, 60], [1, 2, 3, 250]]


@pytest.mark.parametrize("mode", ["pageable", "pinned", "swap", "direct"])
def test_engine_on_a_host_store_generates_what_the_device_table_does(tiny, mode):
    """fnx.load(ple_store=mode) keeps the table out of the params; the engine fetches each step's rows on the host
    and the tokens (greedy) are the ones the in-params table gives, with and without speculative rounds."""
    host = fnx.load(tiny.path, dtype=jnp.bfloat16, ple_store=mode)
    assert host.ple_store.mode == mode
    with pytest.raises(KeyError):
        _params_table(host)
    want = fnx.generate(tiny, PROMPTS, 10)
    assert fnx.generate(host, PROMPTS, 10) == want
    if tiny.mtp and mode == "pageable":
        assert fnx.generate(host, PROMPTS, 10, speculative=2) == fnx.generate(tiny, PROMPTS, 10, speculative=2)
    st_d, st_h = fnx.new_state(tiny, 1, 16), fnx.new_state(host, 1, 16)
    np.testing.assert_array_equal(np.asarray(fnx.extend(tiny, st_d, [PROMPTS[0]])[0], np.float32),
                                  np.asarray(fnx.extend(host, st_h, [PROMPTS[0]])[0], np.float32))
    assert host.ple_store.stats["fetches"] > 0
    host.ple_store.close()


@pytest.mark.parametrize("mode", ["uva", "ring"])
def test_device_path_store_generates_what_the_device_table_does(tiny, mode):
    """fnx.load(ple_store="uva" / "ring"): the params hold a handle (to pinned host memory, or to a ring a host
    thread fills from a pageable mmap) instead of the table, and every program takes its rows through it (on the
    CPU emulated, `emulate`): the plain and speculative engines (overlapped: no host store stops them), the jitted
    generate and extend give the in-params table's tokens and logits. Without a CUDA GPU and without emulation
    the load refuses, saying why."""
    uva = fnx.load(tiny.path, dtype=jnp.bfloat16, ple_store=mode, ple_options={"emulate": True})
    assert uva.ple_store is None and uva.ple_device_store.mode == mode
    assert hasattr(_params_table(uva), "gather")
    want = fnx.generate(tiny, PROMPTS, 10)
    assert fnx.generate(uva, PROMPTS, 10) == want
    if tiny.mtp:
        assert fnx.generate(uva, PROMPTS, 10, speculative=2) == fnx.generate(tiny, PROMPTS, 10, speculative=2)
    for a, b in zip(fnx.generate_jit(uva, PROMPTS[0], 6), fnx.generate_jit(tiny, PROMPTS[0], 6)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    st_d, st_u = fnx.new_state(tiny, 1, 16), fnx.new_state(uva, 1, 16)
    np.testing.assert_array_equal(np.asarray(fnx.extend(tiny, st_d, [PROMPTS[0]])[0], np.float32),
                                  np.asarray(fnx.extend(uva, st_u, [PROMPTS[0]])[0], np.float32))
    with pytest.raises(NotImplementedError, match="mesh with ple_store 'uva' or 'ring'"):
        fnx.engine.Engine(uva, max_slots=1, capacity=32, mesh="tp=1,ep=1")
    if mode == "ring":
        assert uva.ple_device_store.stats["ring_requests"] > 0
        assert uva.ple_device_store.stats["ring_abandoned"] == 0
        eng = fnx.engine.Engine(uva, max_slots=1, capacity=64)   # a prompt's rows prefetched in the backing store
        before = uva.ple_device_store.stats["prefetch_calls"]
        eng.submit(PROMPTS[0])
        eng._last_hint.result(timeout=60)
        assert uva.ple_device_store.stats["prefetch_calls"] >= before + 1
    uva.ple_device_store.close()
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="cannot run here"):
            fnx.load(tiny.path, dtype=jnp.bfloat16, ple_store=mode)


@pytest.mark.parametrize("policy", ["fail", "degrade"])
def test_ring_rows_late_past_the_gpu_deadline(tiny, policy, monkeypatch):
    """Fault injection: the ring's host thread answers one decode request after the GPU stopped waiting (zero rows
    used). policy fail: the running requests end with finish_reason "error" (which rows were zero is not known to
    the engine) and a later request runs clean; degrade: they finish, the miss counted."""
    from fnx.engine.engine import Engine
    from fnx.engine.sampling import SamplingParams

    ring = fnx.load(tiny.path, dtype=jnp.bfloat16, ple_store="ring",
                    ple_options={"emulate": True, "gpu_timeout_s": 0.2, "policy": policy})
    store = ring.ple_device_store
    real = store._serve_one
    slow_host(store, monkeypatch, 0.5, which=3)          # a decode step's request
    eng = Engine(ring, max_slots=2, capacity=64)
    for p in PROMPTS[:2]:
        eng.submit(p, SamplingParams(max_tokens=6))
    outs = []
    while eng.has_work():
        outs += eng.step()
    done = [o for o in outs if o.finished]
    # the next request may miss too (the one host thread is still answering the late one): at least one
    assert store.stats["ring_abandoned"] >= 1 and eng.stats["ple_missing"] >= 1
    if policy == "fail":
        assert {o.finish_reason for o in done} == {"error"}
        time.sleep(0.5)
        monkeypatch.setattr(store, "_serve_one", real)
        rid = eng.submit(PROMPTS[0], SamplingParams(max_tokens=4))
        again = []
        while eng.has_work():
            again += eng.step()
        assert [o.finish_reason for o in again if o.finished and o.request_id == rid] == ["length"]
    else:
        assert {o.finish_reason for o in done} == {"length"}
    store.close()


def test_device_only_paths_refuse_a_host_store(tiny):
    host = fnx.load(tiny.path, dtype=jnp.bfloat16, ple_store="pageable")
    with pytest.raises(NotImplementedError, match="host store"):
        fnx.generate_jit(host, [1, 2, 3], 4)
    with pytest.raises(ValueError, match="ple_store must be one of"):
        fnx.load(tiny.path, ple_store="gpu")
    host.ple_store.close()


@pytest.mark.parametrize("policy,fetch", [("fail", "pipeline"), ("degrade", "sync")])
def test_missing_rows_end_only_the_affected_request(tiny, policy, fetch, monkeypatch):
    """Fault injection: the decode fetches of slot 0's request lose their rows (zero-filled, as after a deadline or
    an unreadable page). policy fail: that request ends with finish_reason "error" and the other one finishes with
    exactly its clean tokens; degrade: both finish, the zero rows counted. The rows reach the step through the
    pipeline thread or a fetch before the step."""
    from fnx.engine.engine import Engine
    from fnx.engine.sampling import SamplingParams
    from fnx.ple.store import Fetch, PleFetchError

    host = fnx.load(tiny.path, dtype=jnp.bfloat16, ple_store="pageable", ple_options={"policy": policy})
    clean = fnx.generate(tiny, PROMPTS, 6)
    real = host.ple_store.fetch

    def lossy(ids, deadline_s=..., *, surface=True):
        got = real(ids, deadline_s, surface=surface)
        if ids.shape[0] == 2:            # a decode step of both slots, one token each: slot 0 loses its rows
            rows, missing = got.rows.copy(), got.missing.copy()
            rows[0], missing[0] = 0, True
            return Fetch(rows, missing, PleFetchError("injected: rows unreadable"))
        return got

    monkeypatch.setattr(host.ple_store, "fetch", lossy)
    eng = Engine(host, max_slots=2, capacity=32, ple_fetch=fetch)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [eng.submit(p, sp) for p in PROMPTS]
    toks, reasons = {i: [] for i in ids}, {}
    while eng.has_work():
        for o in eng.step():
            toks[o.request_id] += o.token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert eng.stats["ple_missing"] >= 1
    if policy == "fail":
        assert reasons[ids[0]] == "error" and eng.stats["ple_failed_requests"] == 1
        assert reasons[ids[1]] == "length" and toks[ids[1]] == clean[1][:6]
    else:
        assert reasons == {ids[0]: "length", ids[1]: "length"} and toks[ids[1]] == clean[1][:6]
    host.ple_store.close()


def test_submit_prefetches_the_prompt_rows(tiny):
    """Prefill hint: on submit, the rows of the whole prompt are prefetched on a background thread."""
    from fnx.engine.engine import Engine
    host = fnx.load(tiny.path, dtype=jnp.bfloat16, ple_store="pageable")
    eng = Engine(host, max_slots=1, capacity=64, prefill_chunk=8)
    before = host.ple_store.stats["prefetch_calls"]
    eng.submit(list(range(3, 43)))
    eng._last_hint.result(timeout=60)
    assert host.ple_store.stats["prefetch_calls"] >= before + 1
    host.ple_store.close()


def test_extend_raises_on_missing_rows_before_touching_the_state(tiny, monkeypatch):
    from fnx.ple.store import Fetch, PleFetchError
    host = fnx.load(tiny.path, dtype=jnp.bfloat16, ple_store="pageable")
    real = host.ple_store.fetch

    def lossy(ids, deadline_s=..., *, surface=True):
        got = real(ids, deadline_s, surface=surface)
        return Fetch(got.rows * 0, np.ones_like(got.missing), PleFetchError("injected"))

    state = fnx.new_state(host, 1, 16)
    monkeypatch.setattr(host.ple_store, "fetch", lossy)
    with pytest.raises(PleFetchError, match="could not be read"):
        fnx.extend(host, state, [PROMPTS[0]])
    monkeypatch.setattr(host.ple_store, "fetch", real)
    logits, _ = fnx.extend(host, state, [PROMPTS[0]])        # the same state, still usable
    st_d = fnx.new_state(tiny, 1, 16)
    np.testing.assert_array_equal(np.asarray(logits, np.float32),
                                  np.asarray(fnx.extend(tiny, st_d, [PROMPTS[0]])[0], np.float32))
    host.ple_store.close()


def test_the_step_split_at_the_ple_layer_equals_the_step(tiny):
    """step_back(step_front(...)) is step: the same logits, state and rollback material, bit for bit."""
    from fnx.model.transformer import layer_plan, ple_split_point, step_back, step_front
    cfg = tiny.cfg
    split = ple_split_point(cfg)
    assert split is not None and cfg.ple_layers[0] in layer_plan(cfg)[split].layers
    toks = jnp.asarray(_tokens(tiny, 2, 5, 7), jnp.int32)
    ids, _ = ngram_ids(initial_context(2, tiny.ngram), np.asarray(toks), tiny.ngram)
    ids = jnp.asarray(ids, jnp.int32)
    state = init_state(cfg, 2, 16, tiny.dtype)
    n_valid = jnp.asarray([5, 3], jnp.int32)
    whole = jax.jit(lambda s: step(tiny.params, s, toks, ids, cfg=cfg, n_valid=n_valid, snapshots=True))(state)
    front = jax.jit(lambda s: step_front(tiny.params, s, toks, cfg=cfg, n_valid=n_valid, snapshots=True))(state)
    halves = jax.jit(lambda s, f: step_back(tiny.params, s, toks, f, ids, cfg=cfg, n_valid=n_valid,
                                            snapshots=True))(state, front)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(halves), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_engine_fetch_variants_generate_the_same_tokens(tiny):
    """Every `ple_fetch` variant (the default, sync, is covered above) gives the device table's greedy tokens,
    and a callback fetch that fails ends the step's requests under policy fail (it cannot say which rows)."""
    from fnx.engine.engine import Engine
    from fnx.engine.sampling import SamplingParams
    want = fnx.generate(tiny, PROMPTS, 6)
    host = fnx.load(tiny.path, dtype=jnp.bfloat16, ple_store="pageable")
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(fetch):
        eng = Engine(host, max_slots=2, capacity=32, ple_fetch=fetch)
        ids = [eng.submit(p, sp) for p in PROMPTS]
        toks, reasons = {i: [] for i in ids}, {}
        while eng.has_work():
            for o in eng.step():
                toks[o.request_id] += o.token_ids
                reasons.update({o.request_id: o.finish_reason} if o.finished else {})
        eng.close()
        return [toks[i] for i in ids], [reasons[i] for i in ids], eng.stats

    for fetch in ("pipeline", "split", "callback-pure", "callback-io", "callback-buffer"):
        toks, reasons, _ = run(fetch)
        assert toks == [w[:6] for w in want] and reasons == ["length", "length"], fetch
    with pytest.raises(ValueError, match="ple_fetch must be one of"):
        Engine(host, ple_fetch="async")

    real = host.ple_store._gather

    def broken(uniq):
        if len(uniq) <= 2 * host.ngram.num_heads:      # decode steps: the rows are lost
            raise OSError("injected: unreadable page")
        return real(uniq)

    host.ple_store._gather = broken
    toks, reasons, stats = run("callback-io")
    assert reasons == ["error", "error"] and stats["ple_failed_requests"] == 2
    host.ple_store._gather = real
    host.ple_store.check()          # nothing left pending: the engine consumed the failure
    host.ple_store.close()
