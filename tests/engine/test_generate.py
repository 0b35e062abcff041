"""generate(): greedy equal to transformers' generate, speculative decoding lossless, batching and chunked prefill
invisible in the output, the jitted loop equal to the engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fnx
from fnx.engine import Engine, SamplingParams, SpeculativeConfig
from tests.engine.conftest import prompts_for

NEW = 10


def _reference(ref, prompt, new):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        g = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=None)
    return g[0, len(prompt):].tolist()


def _no_eos(model, prompts, new=NEW):
    """Engine output with EOS allowed to appear but not stop (transformers is run without an EOS too)."""
    return fnx.generate(model, prompts, max_new_tokens=new, sampling=SamplingParams(ignore_eos=True))


@pytest.mark.parametrize("name", ["tiny-a", "tiny-c"])
def test_greedy_equals_transformers(tiny_models, name):
    model, ref = tiny_models(name)
    prompts = prompts_for(model)
    out = _no_eos(model, prompts)
    for p, o in zip(prompts, out):
        assert o == _reference(ref, p, NEW)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_greedy_is_lossless(tiny_models, k):
    model, _ = tiny_models("tiny-a")
    prompts = prompts_for(model, seed=1)
    plain = _no_eos(model, prompts, 14)
    spec = fnx.generate(model, prompts, max_new_tokens=14, sampling=SamplingParams(ignore_eos=True), speculative=k)
    assert spec == plain


def test_mixed_batch_and_slot_reuse(tiny_models):
    """Three requests of different lengths through two slots: each gets what it gets alone."""
    model, _ = tiny_models("tiny-c")
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, 300, size=n))) for n in (5, 30, 12)]
    together = fnx.generate(model, prompts, max_new_tokens=8, max_slots=2,
                            sampling=SamplingParams(ignore_eos=True))
    alone = [fnx.generate(model, [p], max_new_tokens=8, sampling=SamplingParams(ignore_eos=True))[0]
             for p in prompts]
    assert together == alone


def test_chunked_prefill_chunk_sizes(tiny_models):
    model, _ = tiny_models("tiny-a")
    prompt = prompts_for(model, seed=2)[1]
    outs = []
    for chunk in (3, 16, 512):
        eng = Engine(model, max_slots=1, capacity=128, prefill_chunk=chunk)
        outs.append(fnx.generate(model, [prompt], max_new_tokens=6, engine=eng,
                                 sampling=SamplingParams(ignore_eos=True))[0])
    assert outs[0] == outs[1] == outs[2]
    # and at the model level: chunked extend gives the same logits and the same state
    ids = np.asarray([prompt])
    s1 = fnx.new_state(model, 1, 64)
    whole, s1 = fnx.extend(model, s1, ids)
    s2 = fnx.new_state(model, 1, 64)
    parts = []
    for a in range(0, ids.shape[1], 7):
        lg, s2 = fnx.extend(model, s2, ids[:, a:a + 7])
        parts.append(np.asarray(lg))
    np.testing.assert_allclose(np.concatenate(parts, 1), np.asarray(whole), rtol=1e-4, atol=1e-4)
    import jax
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-4, atol=1e-4)


def test_generate_jit_equals_engine(tiny_models):
    model, _ = tiny_models("tiny-a")
    rng = np.random.default_rng(7)
    prompts = [list(map(int, rng.integers(0, 250, size=11))) for _ in range(2)]
    prompts[1][3] = model.cfg.ple_eos_token_id
    toks, lengths = fnx.generate_jit(model, prompts, 9, SamplingParams(ignore_eos=True))
    assert np.asarray(lengths).tolist() == [9, 9]
    assert np.asarray(toks).tolist() == _no_eos(model, prompts, 9)
    # the prompt prefilled in chunks (two of 4 under a scan, then 3), as a long prompt is: the same tokens
    chunked, _ = fnx.generate_jit(model, prompts, 9, SamplingParams(ignore_eos=True), prefill_chunk=4)
    assert np.asarray(chunked).tolist() == np.asarray(toks).tolist()
    with pytest.raises(ValueError, match="prefill_chunk must be"):
        fnx.generate_jit(model, prompts, 9, prefill_chunk=0)
    # penalties: the seen tokens (prompt and output) and the output counts carried through the loop, as the engine
    # keeps them (greedy, so the tokens must be the engine's), and they change the text
    pen = SamplingParams(ignore_eos=True, repetition_penalty=1.8, presence_penalty=0.7, frequency_penalty=0.5)
    toks_pen, _ = fnx.generate_jit(model, prompts, 9, pen)
    assert np.asarray(toks_pen).tolist() == fnx.generate(model, prompts, max_new_tokens=9, sampling=pen)
    assert np.asarray(toks_pen).tolist() != np.asarray(toks).tolist()


def test_stream_and_stops(tiny_models):
    model, _ = tiny_models("tiny-a")
    prompt = prompts_for(model)[0]
    greedy = _no_eos(model, [prompt], 8)[0]
    stop = greedy[3]
    events = list(fnx.generate(model, [prompt], max_new_tokens=8, stream=True,
                               sampling=SamplingParams(ignore_eos=True, stop_token_ids=(stop,))))
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == greedy[:greedy.index(stop) + 1]
    assert events[-1].finished and events[-1].finish_reason == "stop"
    events = list(fnx.generate(model, [prompt], max_new_tokens=3, stream=True,
                               sampling=SamplingParams(ignore_eos=True)))
    assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 3


def test_sampling_seeded_and_logprobs(tiny_models):
    model, _ = tiny_models("tiny-a")
    prompt = prompts_for(model)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=11, ignore_eos=True, logprobs=3)
    a = fnx.generate(model, [prompt], max_new_tokens=8, sampling=sp)
    b = fnx.generate(model, [prompt], max_new_tokens=8, sampling=sp)
    c = fnx.generate(model, [prompt], max_new_tokens=8, sampling=SamplingParams(temperature=1.0, seed=12,
                                                                                ignore_eos=True))
    assert a == b and a != c
    ev = list(fnx.generate(model, [prompt], max_new_tokens=2, sampling=sp, stream=True))
    lp = ev[0].logprobs[0]
    assert lp["logprob"] <= 0 and len(lp["top"]) == 3 and lp["top"][0][1] >= lp["top"][1][1]


def test_errors(tiny_models):
    model, _ = tiny_models("tiny-a")
    eng = Engine(model, max_slots=1, capacity=32)
    with pytest.raises(ValueError, match="context capacity"):
        eng.submit(list(range(20)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="token ids must lie"):
        eng.submit([1, 2, model.cfg.vocab_size])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="speculative k"):
        Engine(model, speculative=9)


def test_vmap_of_jitted_generate_equals_loop(tiny_models):
    import jax
    import jax.numpy as jnp
    from fnx.engine import generate_fn
    model, _ = tiny_models("tiny-a")
    rng = np.random.default_rng(9)
    prompts = jnp.asarray(rng.integers(0, 250, size=(3, 7)), jnp.int32)
    seeds = jnp.arange(3, dtype=jnp.uint32) + 5
    gen = generate_fn(model, 6, SamplingParams(temperature=1.0, ignore_eos=True))
    toks, lengths = jax.jit(jax.vmap(gen))(prompts, seeds)
    one = jax.jit(gen)
    for i in range(3):
        t, n = one(prompts[i], seeds[i])
        assert np.asarray(t).tolist() == np.asarray(toks[i]).tolist() and int(n) == int(lengths[i]) == 6


def test_hot_token_and_fp8_draft_heads_are_lossless(tiny_models, tmp_path):
    from fnx.engine import SpeculativeConfig
    model, _ = tiny_models("tiny-a")
    prompts = prompts_for(model, seed=1)
    hot = tmp_path / "hot.txt"
    hot.write_text(" ".join(str(i) for i in range(0, model.cfg.vocab_size, 2)))
    plain = _no_eos(model, prompts, 10)
    spec = fnx.generate(model, prompts, max_new_tokens=10, sampling=SamplingParams(ignore_eos=True),
                        speculative=SpeculativeConfig(k=3, draft_vocab=str(hot)))
    assert spec == plain
    fp8 = fnx.generate(model, prompts, max_new_tokens=10, sampling=SamplingParams(ignore_eos=True),
                       speculative=SpeculativeConfig(k=2, draft_vocab=str(hot), fp8_head=True))
    assert fp8 == plain
    with pytest.raises(ValueError, match="draft vocabulary"):
        Engine(model, speculative=SpeculativeConfig(k=2, draft_vocab=[model.cfg.vocab_size]))


def test_greedy_drafts_through_the_fused_argmax_match_the_sampling_drafts(tiny_models, monkeypatch):
    """A greedy batch drafts through the fused head argmax (`_jit_draft(greedy=True)`) and verifies by argmax
    (`_jit_verify(greedy=True)`, no distributions; both inside `_jit_spec_round`): the same drafts, the same
    acceptance and the same output as the general sampling programs at temperature 0."""
    import fnx.engine.engine as eng_mod
    model, _ = tiny_models("tiny-a")
    prompts = prompts_for(model, seed=3)
    runs = {}
    real = eng_mod._jit_spec_round     # the round's program: draft, verify window and verify in one
    for force_general in (False, True):
        seen = []

        def spy(*a, greedy=False, **kw):
            seen.append(greedy)
            return real(*a, greedy=False if force_general else greedy, **kw)
        monkeypatch.setattr(eng_mod, "_jit_spec_round", spy)
        eng = Engine(model, max_slots=2, capacity=128, speculative=SpeculativeConfig(k=3))
        ids = [eng.submit(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        outs = {i: [] for i in ids}
        while eng.has_work():
            for o in eng.step():
                outs[o.request_id] += o.token_ids
        assert seen and all(seen)          # every round of this all-greedy batch asked for the greedy program
        runs[force_general] = ([outs[i] for i in ids], eng.stats["accepted"], eng.stats["drafted"])
    assert runs[False] == runs[True]


def _run_engine(eng, reqs, abort_id=None, abort_at=3):
    """Submit (prompt, params) pairs, drive the engine to the end; abort `abort_id` once it has emitted
    `abort_at` tokens. Returns {id: (tokens, logprobs, finish_reason)}."""
    got = {}
    for i, (p, sp) in enumerate(reqs):
        eng.submit(p, sp, request_id=f"r{i}")
        got[f"r{i}"] = ([], [], None)
    aborted = False
    while eng.has_work():
        for o in eng.step():
            toks, lps, _ = got[o.request_id]
            toks += o.token_ids
            lps += [(lp["logprob"], lp.get("top")) for lp in o.logprobs]
            if o.finished:
                got[o.request_id] = (toks, lps, o.finish_reason)
        if abort_id and not aborted and len(got[abort_id][0]) >= abort_at:
            eng.abort(abort_id)
            aborted = True
    return got


def _assert_same_outputs(sync, over):
    """Tokens, finish reasons and the logprobs' shape exactly; logprob values to float rounding: the engines run
    different compiled programs (the overlapped one takes its inputs on the device), and each is deterministic, but
    they may round the same row differently in the last bit (seen: 1e-7 relative)."""
    assert over.keys() == sync.keys()
    for rid in sync:
        (ts, ls, fs), (to, lo, fo) = sync[rid], over[rid]
        assert to == ts and fo == fs and len(lo) == len(ls), rid
        for (a, top_a), (b, top_b) in zip(ls, lo):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (rid, a, b)
            assert (top_a is None) == (top_b is None)
            if top_a is not None:
                assert [i for i, _ in top_a] == [i for i, _ in top_b]
                np.testing.assert_allclose([v for _, v in top_a], [v for _, v in top_b], rtol=1e-5, atol=1e-6)


def test_overlapped_decode_equals_the_synchronous_engine(tiny_models):
    """The overlapped engine (each step launched before the previous step's tokens reach the host, tokens and
    n-gram ids taken on the device) emits the tokens the synchronous one does (logprobs to float rounding): greedy
    and seeded sampling, penalties, logprobs, stop tokens, EOS, slot reuse across 4 requests in 2 slots, and an
    abort mid-flight."""
    model, _ = tiny_models("tiny-c")
    rng = np.random.default_rng(9)
    eos = model.cfg.ple_eos_token_id
    prompts = [list(map(int, rng.integers(0, eos, size=n))) for n in (6, 23, 11, 4)]
    prompts[1][7] = eos
    greedy = fnx.generate(model, [prompts[0]], max_new_tokens=12, sampling=SamplingParams(ignore_eos=True))[0]
    reqs = [
        (prompts[0], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(greedy[6],))),
        (prompts[1], SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95, seed=3, logprobs=2,
                                    repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True)),
        (prompts[2], SamplingParams(max_tokens=7, temperature=1.2, seed=5, ignore_eos=True)),
        (prompts[3], SamplingParams(max_tokens=10, temperature=0.7, seed=8, presence_penalty=0.4)),
    ]
    runs = []
    for overlap in (False, True):
        eng = Engine(model, max_slots=2, capacity=64, prefill_chunk=8, overlap=overlap)
        assert eng.overlap == overlap
        runs.append(_run_engine(eng, reqs, abort_id="r2"))
        assert not eng.has_work() and eng._inflight is None
    sync, over = runs
    _assert_same_outputs(sync, over)
    assert sync["r0"][2] == "stop" and sync["r0"][0][-1] == greedy[6]
    assert sync["r1"][2] == "length" and len(sync["r1"][1]) == 9 and len(sync["r1"][1][0][1]) == 2
    assert len(sync["r2"][0]) == 3 and sync["r2"][2] is None      # aborted after 3 tokens, in both engines


@pytest.mark.parametrize("spec", [None, 3])
def test_overlapped_decode_keeps_its_buffers_in_place(tiny_models, spec):
    """Every buffer the overlapped step program (or speculative round program) reads or writes keeps its device
    address from step to step (on a GPU, XLA re-records the program's whole CUDA graph before a launch in which one
    has moved): the host rows, the token / accepted-count / hidden / logprob buffers, the states, the penalty
    counts; the host reads copies (written into two buffer sets in turn: nothing is allocated between launches),
    so the outputs of a step still in flight stay readable after the next step overwrites the buffers."""
    model, _ = tiny_models("tiny-a")
    eng = Engine(model, max_slots=2, capacity=96, prefill_chunk=8, speculative=spec)
    assert eng.overlap
    eng.submit([3, 1, 4, 1, 5], SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True), request_id="a")
    eng.submit([2, 7, 1], SamplingParams(max_tokens=12, temperature=0.8, seed=1, repetition_penalty=1.2,
                                         ignore_eos=True), request_id="b")

    def addresses():
        tree = {"io": eng._spec_io if spec else eng._io, "state": eng.state, "seen": eng.seen,
                "counts": eng.out_counts, "mtp": eng.mtp_state if spec else None}
        return {jax.tree_util.keystr(k): v.unsafe_buffer_pointer()
                for k, v in jax.tree_util.tree_flatten_with_path(tree)[0] if v.size}

    seen, copies, emitted = [], [], 0
    while eng.has_work():
        emitted += sum(len(o.token_ids) for o in eng.step())
        if eng._inflight is not None and (eng._spec_io if spec else eng._io) is not None:
            seen.append(addresses())
            copies.append(eng._inflight.tokens.unsafe_buffer_pointer())
    assert emitted == 24 and len(seen) >= 3, (emitted, len(seen))
    assert all(a == seen[0] for a in seen[1:]), [k for k in seen[0] if any(a.get(k) != seen[0][k] for a in seen)]
    # the copies the host reads: two buffer sets written in turn (nothing allocated between launches)
    assert copies[0] != copies[1] and copies == [copies[i % 2] for i in range(len(copies))], copies
    want = ({"['io']['host']['hid']", "['io']['out']['tok']", "['io']['lp'][20][0]", "['mtp']['pos']"} if spec else
            {"['io']['packed']", "['io']['tok']", "['io']['lp'][20][0]"})
    assert want <= set(seen[0]), sorted(seen[0])[:8]


def test_overlap_is_off_where_the_host_needs_each_token(tiny_models):
    """Plain and speculative engines overlap by default; overlap=False turns it off. An overlapped speculative
    engine reserves k - 1 more cache positions per request (the round it may run after a request's last tokens)."""
    model, _ = tiny_models("tiny-a")
    assert Engine(model, max_slots=1, capacity=64).overlap
    spec = Engine(model, max_slots=1, capacity=64, speculative=3)
    assert spec.overlap and spec.reserve == 3 + 1 + 2
    assert Engine(model, max_slots=1, capacity=64, speculative=3, overlap=False).reserve == 3 + 1
    assert Engine(model, max_slots=1, capacity=64).reserve == 1
    assert not Engine(model, max_slots=1, capacity=64, overlap=False).overlap
    with pytest.raises(ValueError, match="context capacity"):
        spec.submit([1, 2, 3, 4], SamplingParams(max_tokens=64 - 4 - 6 + 1))
    spec.submit([1, 2, 3, 4], SamplingParams(max_tokens=64 - 4 - 6))


def test_overlapped_speculative_rounds_equal_the_synchronous_engine(tiny_models):
    """Overlapped MTP rounds (each round launched before the previous one's tokens reach the host: the MTP layer's
    pairs, the pending token and the sampling counters taken on the device) emit the tokens of the synchronous
    engine: greedy and seeded sampling rows in one batch, logprobs, a stop token inside an accepted window, max_tokens
    cutting a window, slot reuse across 4 requests in 2 slots, an abort mid-flight; and the same acceptance counts."""
    model, _ = tiny_models("tiny-c")
    rng = np.random.default_rng(21)
    eos = model.cfg.ple_eos_token_id
    prompts = [list(map(int, rng.integers(0, eos, size=n))) for n in (6, 19, 9, 5)]
    greedy = fnx.generate(model, [prompts[0]], max_new_tokens=14, sampling=SamplingParams(ignore_eos=True))[0]
    reqs = [
        (prompts[0], SamplingParams(max_tokens=14, ignore_eos=True, stop_token_ids=(greedy[8],))),
        (prompts[1], SamplingParams(max_tokens=11, temperature=0.9, top_p=0.95, seed=3, logprobs=2,
                                    ignore_eos=True)),
        (prompts[2], SamplingParams(max_tokens=9, temperature=1.2, seed=5, ignore_eos=True)),
        (prompts[3], SamplingParams(max_tokens=7, ignore_eos=True)),
    ]
    from fnx.engine import engine as eng_mod
    runs, stats, compiled = [], [], []
    for overlap in (False, True):
        eng = Engine(model, max_slots=2, capacity=96, prefill_chunk=8, overlap=overlap,
                     speculative=SpeculativeConfig(k=3))
        assert eng.overlap == overlap
        runs.append(_run_engine(eng, reqs, abort_id="r2", abort_at=4))
        assert not eng.has_work() and eng._inflight is None
        stats.append((eng.stats["accepted"], eng.stats["row_rounds"]))
        compiled.append(eng_mod._jit_spec_round._cache_size())
    # rounds with inputs from the device and rounds with inputs from the host run one compiled program (so the
    # server's warm-up, whose requests end after one round, compiles it)
    assert compiled[0] == compiled[1] > 0
    sync, over = runs
    _assert_same_outputs(sync, over)
    assert stats[0] == stats[1]
    assert sync["r0"][2] == "stop" and sync["r0"][0][-1] == greedy[8]
    assert sync["r3"][2] == "length" and len(sync["r3"][0]) == 7
    assert sync["r1"][2] == "length" and len(sync["r1"][1]) == 11 and len(sync["r1"][1][0][1]) == 2
    assert sync["r2"][2] is None and 4 <= len(sync["r2"][0]) < 9        # aborted after a round past 4 tokens


def test_speculative_rounds_with_penalties_are_lossless(tiny_models):
    """Repetition / presence / frequency penalties under MTP speculation: greedy rows with penalties emit what the
    plain engine emits for them (each window position penalized with the drafts before it), beside rows without
    penalties in the same batch and slot reuse; sampled rows with penalties run overlapped as synchronously (the
    same seeded tokens), and the penalties move the greedy text (they act)."""
    model, _ = tiny_models("tiny-c")
    rng = np.random.default_rng(33)
    eos = model.cfg.ple_eos_token_id
    prompts = [list(map(int, rng.integers(0, eos, size=n))) for n in (7, 12, 5)]
    pen = dict(repetition_penalty=1.6, presence_penalty=0.6, frequency_penalty=0.4, ignore_eos=True)
    greedy = [(prompts[0], SamplingParams(max_tokens=16, **pen)),
              (prompts[1], SamplingParams(max_tokens=12, ignore_eos=True)),
              (prompts[2], SamplingParams(max_tokens=14, repetition_penalty=2.0, ignore_eos=True))]
    plain = _run_engine(Engine(model, max_slots=2, capacity=96, prefill_chunk=8), greedy)
    spec = Engine(model, max_slots=2, capacity=96, prefill_chunk=8, speculative=SpeculativeConfig(k=3))
    got = _run_engine(spec, greedy)
    # (this tiny model's MTP layer is random, so its drafts are rarely accepted: tests/quality/test_fnx_mini.py
    # runs the same comparison where windows are accepted)
    assert {r: v[0] for r, v in got.items()} == {r: v[0] for r, v in plain.items()}
    unpenalized = fnx.generate(model, [prompts[0]], max_new_tokens=16, sampling=SamplingParams(ignore_eos=True))[0]
    assert got["r0"][0] != unpenalized
    sampled = [(prompts[0], SamplingParams(max_tokens=10, temperature=0.8, seed=4, **pen)),
               (prompts[1], SamplingParams(max_tokens=9, temperature=1.1, seed=6, presence_penalty=1.0))]
    runs = [_run_engine(Engine(model, max_slots=2, capacity=96, prefill_chunk=8, overlap=o,
                               speculative=SpeculativeConfig(k=2)), sampled) for o in (False, True)]
    assert {r: v[0] for r, v in runs[0].items()} == {r: v[0] for r, v in runs[1].items()}
    assert [len(v[0]) for v in runs[0].values()] == [10, 9]


def test_penalized_window_and_commit_follow_the_history():
    """`spec.penalized_window`: position j is penalized as one plain step would be after the drafts before it;
    `commit_window` adds each active row's emitted tokens (repeats counted), nothing for inactive rows."""
    from fnx.engine.sampling import SamplingArrays, apply_penalties
    from fnx.engine.spec import commit_window, penalized_window
    rng = np.random.default_rng(2)
    b, w, v = 3, 4, 11
    logits = jnp.asarray(rng.standard_normal((b, w, v)), jnp.float32)
    seen = jnp.asarray(rng.random((b, v)) < 0.3)
    counts = jnp.asarray(rng.integers(0, 3, (b, v)) * np.asarray(seen), jnp.int32)
    drafts = jnp.asarray([[1, 1, 5], [2, 3, 4], [0, 9, 0]], jnp.int32)
    sp = SamplingArrays.stack([SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2),
                               SamplingParams(), SamplingParams(repetition_penalty=0.7, frequency_penalty=1.0)])
    got = np.asarray(penalized_window(logits, sp, seen, counts, drafts))
    s, c = np.asarray(seen).copy(), np.asarray(counts).copy()
    for j in range(w):
        want = np.asarray(apply_penalties(logits[:, j], sp, jnp.asarray(s), jnp.asarray(c)))
        np.testing.assert_array_equal(got[:, j], want)
        if j < w - 1:
            for r in range(b):
                s[r, int(drafts[r, j])] = True
                c[r, int(drafts[r, j])] += 1
    np.testing.assert_array_equal(got[1], np.asarray(logits[1]))          # no penalties: the logits as they are
    toks = jnp.asarray([[4, 4, 7, 0], [1, 2, 3, 5], [6, 6, 6, 6]], jnp.int32)
    n_acc, active = jnp.asarray([2, 0, 3]), jnp.asarray([True, True, False])
    s2, c2 = commit_window(seen, counts, toks, n_acc, active)
    want_s, want_c = np.asarray(seen).copy(), np.asarray(counts).copy()
    for r, emitted in ((0, [4, 4, 7]), (1, [1])):
        for t in emitted:
            want_s[r, t] = True
            want_c[r, t] += 1
    np.testing.assert_array_equal(np.asarray(s2), want_s)
    np.testing.assert_array_equal(np.asarray(c2), want_c)


def test_draft_program_makes_one_counter_pool(tiny_models, monkeypatch):
    """Where the kernels take counters (here `FNX_GEMV_FINISH=1`) the draft program's catch-up and chained MTP steps
    share one counter pool: one zeroing launch for the program, not one per step; the drafts are the same."""
    from fnx.engine.engine import _jit_draft
    from fnx.engine.sampling import SamplingArrays, SamplingParams
    from fnx.model.mtp import init_mtp_state, mtp_params
    from fnx.pallas.gemv import api as gemv_api
    model, _ = tiny_models("tiny-a")
    cfg, params = model.cfg, model.params
    mp = mtp_params(cfg, model.mtp, np.float32)
    bsz, length, k = 2, 3, 3
    key = jax.random.PRNGKey(4)
    hidden = jax.random.normal(key, (bsz, length, cfg.hc_dim), jnp.float32)
    toks = jax.random.randint(jax.random.fold_in(key, 1), (bsz, length), 0, params["lm_head"].shape[0])
    count = jnp.array([3, 2], jnp.int32)
    sp = SamplingArrays.stack([SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=0.0, seed=2)])
    keys = jax.random.split(jax.random.fold_in(key, 2), bsz)

    def run():
        return _jit_draft(params, mp, init_mtp_state(cfg, bsz, 32, jnp.float32), hidden, toks, count, sp, keys, cfg,
                          "auto", k, greedy=True)[1]
    drafts = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(gemv_api.FINISH_ENV, flag)
        jax.clear_caches()          # (the knob is read when a program is traced)
        text = str(jax.make_jaxpr(run)())
        assert text.count("fnx_grid_sync_init") == (1 if flag == "1" else 0), flag
        drafts[flag] = np.asarray(run())
    np.testing.assert_array_equal(drafts["1"], drafts["0"])


def test_drafts_write_the_committed_caches_in_place(tiny_models, monkeypatch):
    """The chained draft steps write the MTP layer's KV rows and block keys in the committed state's own buffers
    (`engine.draft_state_in_place`): over rounds of catch-ups of 1 to k+1 pairs (a block completed by drafts, the
    indexer ring wrapped onto committed positions) the drafts and every cache row below each row's pos are those of
    a drafter whose chained steps write a copy (`FNX_MTP_DRAFT_IN_PLACE=0`); the rows past pos hold the drafts'
    entries, so the returned caches are the drafts' buffers (what lets XLA update one buffer; the copy it saves is
    measured on a GPU, the CPU build copies these caches for its layouts either way); a bad value raises."""
    from fnx.engine import engine
    from fnx.engine.sampling import SamplingArrays, SamplingParams
    from fnx.model.mtp import init_mtp_state, mtp_params
    from fnx.pallas import grid_sync
    from fnx.model.transformer import counter_pool
    model, _ = tiny_models("tiny-a")
    cfg, params = model.cfg, model.params
    mp = mtp_params(cfg, model.mtp, np.float32)
    bsz, k, cap = 2, 4, 64
    sp = SamplingArrays.stack([SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=0.0, seed=2)])

    def program(in_place):
        def body(m, hidden, toks, count, keys):
            with grid_sync.counter_pool(counter_pool(toks.size, None)):
                return engine._draft_body(params, mp, m, hidden, toks, count, sp, keys, cfg, "auto", k, None, None,
                                          True, None)
        def traced(*a):
            with monkeypatch.context() as mctx:
                mctx.setenv(engine.DRAFT_IN_PLACE_ENV, "1" if in_place else "0")
                return body(*a)
        return jax.jit(traced, donate_argnums=0)
    runs = {True: program(True), False: program(False)}
    states = {v: init_mtp_state(cfg, bsz, cap, jnp.float32) for v in runs}
    key = jax.random.PRNGKey(7)
    counts = [[3, 5], [1, 4], [5, 2], [2, 1], [4, 3]]
    cr = cfg.indexer_compress_ratio
    beyond = 0
    for r, cnt in enumerate(counts):
        kr = jax.random.fold_in(key, r)
        hidden = jax.random.normal(kr, (bsz, k + 1, cfg.hc_dim), jnp.float32)
        toks = jax.random.randint(jax.random.fold_in(kr, 1), (bsz, k + 1), 0, params["lm_head"].shape[0])
        keys = jax.random.split(jax.random.fold_in(kr, 2), bsz)
        out = {v: runs[v](states[v], hidden, toks, jnp.array(cnt, jnp.int32), keys) for v in runs}
        np.testing.assert_array_equal(np.asarray(out[True][1]), np.asarray(out[False][1]), err_msg=f"round {r}")
        states = {v: out[v][0] for v in runs}
        pos = np.asarray(states[True]["pos"])
        np.testing.assert_array_equal(pos, np.asarray(states[False]["pos"]))
        a, b = states[True]["layer"], states[False]["layer"]
        np.testing.assert_array_equal(np.asarray(a["idx_ring"]), np.asarray(b["idx_ring"]))
        for row in range(bsz):
            p = int(pos[row])
            for name, upto in (("k", p), ("v", p), ("idx_blocks", p // cr)):
                x, y = np.asarray(a[name])[row], np.asarray(b[name])[row]
                axis = 1 if name != "idx_blocks" else 0
                np.testing.assert_array_equal(np.take(x, range(upto), axis), np.take(y, range(upto), axis),
                                              err_msg=f"round {r} row {row} {name}")
                beyond += int(np.any(np.take(x, range(p, p + k - 1), 1) != 0)) if name == "k" else 0
    assert beyond > 0, "the drafts' KV rows past pos should be in the committed buffers"
    monkeypatch.setenv(engine.DRAFT_IN_PLACE_ENV, "yes")
    with pytest.raises(ValueError, match="FNX_MTP_DRAFT_IN_PLACE"):
        engine.draft_state_in_place(states[True], states[True])


@pytest.mark.parametrize("subset", [False, True])
def test_penalized_drafts_follow_the_verify_window_history(tiny_models, subset):
    """With penalties (`_jit_draft(pen=...)`) draft i comes from the drafter's logits penalized with the history and
    drafts 0..i-1, as the verify penalizes window position i: greedy rows take that argmax (not the fused head's
    unpenalized one), sampled rows return that filtered distribution as q. Over the full head and a hot subset
    (-inf outside it); a row without penalties drafts as before, and the penalties move the penalized row's drafts."""
    from fnx.engine.engine import _jit_draft, draft_head
    from fnx.engine.sampling import SamplingArrays, apply_penalties, filtered_logprobs
    from fnx.model.mtp import init_mtp_state, mtp_params, mtp_step
    model, _ = tiny_models("tiny-a")
    cfg, params = model.cfg, model.params
    vocab = params["lm_head"].shape[0]
    mp = mtp_params(cfg, model.mtp, np.float32)
    bsz, length, k = 3, 3, 3
    key = jax.random.PRNGKey(11)
    hidden = jax.random.normal(key, (bsz, length, cfg.hc_dim), jnp.float32)
    toks = jax.random.randint(jax.random.fold_in(key, 1), (bsz, length), 0, vocab)
    count = jnp.array([3, 1, 2], jnp.int32)
    rng = np.random.default_rng(5)
    seen = jnp.asarray(rng.random((bsz, vocab)) < 0.5)
    counts = jnp.asarray(rng.integers(0, 3, (bsz, vocab)) * np.asarray(seen), jnp.int32)
    hot = jnp.asarray(np.sort(rng.choice(vocab, vocab // 2, replace=False)).astype(np.int32)) if subset else None
    head = draft_head(params["lm_head"], hot, False, jnp.float32) if subset else None
    keys = jax.random.split(jax.random.fold_in(key, 2), bsz)

    def widen(lg):
        lg = lg.astype(jnp.float32)
        return lg if hot is None else jnp.full((bsz, vocab), -jnp.inf).at[:, hot].set(lg)

    def reference(sp, drafts):
        """Each draft position's penalized drafter logits, chained through the given drafts."""
        st = init_mtp_state(cfg, bsz, 32, jnp.float32)
        lg, st, h = mtp_step(params, mp, st, hidden, toks, cfg=cfg, n_valid=count, head=head, at=count - 1)
        hh = jnp.take_along_axis(h, (count - 1)[:, None, None], axis=1)
        s, c, out = seen, counts, []
        for i in range(k):
            out.append(apply_penalties(widen(lg[:, 0]), sp, s, c))
            tok = drafts[:, i]
            s, c = s.at[jnp.arange(bsz), tok].set(True), c.at[jnp.arange(bsz), tok].add(1)
            lg, st, hh = mtp_step(params, mp, st, hh, tok[:, None], cfg=cfg, head=head)
        return out

    strong = dict(repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=2.0)
    for temperature in (0.0, 0.9):
        sp = SamplingArrays.stack([SamplingParams(temperature=temperature, seed=1, **strong),
                                   SamplingParams(temperature=temperature, seed=2),
                                   SamplingParams(temperature=temperature, seed=3, repetition_penalty=0.5)])
        greedy = temperature == 0.0
        run = lambda pen: _jit_draft(params, mp, init_mtp_state(cfg, bsz, 32, jnp.float32), hidden, toks,  # noqa
                                     count, sp, keys, cfg, "auto", k, head, hot, greedy=greedy, pen=pen)
        _, drafts, q_lp = run((seen, counts))
        _, plain, _ = run(None)
        want = reference(sp, drafts)
        if greedy:
            assert q_lp is None
            np.testing.assert_array_equal(np.asarray(drafts), np.stack([np.argmax(w, -1) for w in want], 1))
            np.testing.assert_array_equal(np.asarray(drafts[1]), np.asarray(plain[1]))   # no penalties: as before
            assert (np.asarray(drafts[0]) != np.asarray(plain[0])).any()                # the penalties act
        else:
            for i in range(k):
                # as probabilities: the jitted and the eager logits differ by float error, which can move the
                # top-p cut of a token of probability ~1e-9
                np.testing.assert_allclose(np.exp(np.asarray(q_lp[:, i])),
                                           np.exp(np.asarray(filtered_logprobs(want[i], sp))), rtol=1e-4, atol=1e-6)
        if subset:
            assert np.isin(np.asarray(drafts), np.asarray(hot)).all()


def test_mtp_head_at_one_position_per_row_equals_the_full_head(tiny_models):
    """`mtp_step(at=...)` (the drafter's catch-up: only each row's last valid position feeds the first draft) gives
    those rows' logits of the full-window head, the same state and the same hidden; with head_fn as well."""
    from fnx.model.mtp import init_mtp_state, mtp_params, mtp_step
    from fnx.model.ops import linear_argmax
    model, _ = tiny_models("tiny-a")
    cfg, params = model.cfg, model.params
    mp = mtp_params(cfg, model.mtp, np.float32)
    bsz, length = 3, 4
    key = jax.random.PRNGKey(7)
    hidden = jax.random.normal(key, (bsz, length, cfg.hc_dim), jnp.float32)
    toks = jax.random.randint(jax.random.fold_in(key, 1), (bsz, length), 0, cfg.vocab_size)
    count = jnp.array([4, 1, 3], jnp.int32)
    st = init_mtp_state(cfg, bsz, 32, jnp.float32)
    full, st_full, h_full = mtp_step(params, mp, st, hidden, toks, cfg=cfg, n_valid=count)
    one, st_one, h_one = mtp_step(params, mp, st, hidden, toks, cfg=cfg, n_valid=count, at=count - 1)
    assert one.shape == (bsz, 1, cfg.vocab_size)
    want = np.asarray(full)[np.arange(bsz), np.asarray(count) - 1]
    np.testing.assert_allclose(np.asarray(one)[:, 0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(h_one), np.asarray(h_full))
    for a, b in zip(jax.tree.leaves(st_one), jax.tree.leaves(st_full)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids, _, _ = mtp_step(params, mp, st, hidden, toks, cfg=cfg, n_valid=count, at=count - 1,
                         head_fn=lambda out, rows: linear_argmax(out, rows))
    assert ids.shape == (bsz, 1)
    np.testing.assert_array_equal(np.asarray(ids)[:, 0], want.argmax(-1))


def test_mtp_params_accept_a_built_tree(tiny_models):
    """The MTP layer's weights as a params tree (what benchmarks build from random weights) give the engine the same
    params as the checkpoint's raw `mtp.*` tensors; a wrong shape, a missing or an unknown leaf is refused by name."""
    from fnx.model.mtp import MtpError, mtp_params
    model, _ = tiny_models("tiny-a")
    tree = mtp_params(model.cfg, model.mtp, np.float32)
    again = mtp_params(model.cfg, tree, np.float32)
    flat_a, flat_b = jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.tree_leaves_with_path(again)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (_, a), (_, b) in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bad = dict(tree, fc_hidden=tree["fc_hidden"][:, :-1])
    with pytest.raises(MtpError, match="fc_hidden has shape"):
        mtp_params(model.cfg, bad, np.float32)
    with pytest.raises(MtpError, match="missing mtp tensors"):
        mtp_params(model.cfg, {k: v for k, v in tree.items() if k != "fc_embedding"}, np.float32)
    with pytest.raises(MtpError, match="unexpected mtp tensors"):
        mtp_params(model.cfg, dict(tree, extra=tree["fc_hidden"]), np.float32)


@pytest.mark.parametrize("spec", [None, 2])
def test_prompt_logprobs_equal_the_forward_pass(tiny_models, spec):
    """`SamplingParams.prompt_logprobs`: with the request's first token, one entry per prompt token (None for the
    first), each the log-softmax of the forward pass's logits at the position before it, and its top n; across
    prefill chunks (the chunk's last position scores the next chunk's first token), beside a request without them,
    plain and speculative."""
    model, _ = tiny_models("tiny-c")
    rng = np.random.default_rng(12)
    prompt = list(map(int, rng.integers(0, model.cfg.ple_eos_token_id, size=37)))
    eng = Engine(model, max_slots=2, capacity=96, prefill_chunk=16, speculative=spec)
    eng.submit(prompt, SamplingParams(max_tokens=3, prompt_logprobs=2), request_id="a")
    eng.submit(prompt[:9], SamplingParams(max_tokens=3), request_id="b")
    first = {}
    while eng.has_work():
        for o in eng.step():
            first.setdefault(o.request_id, o)
    plp = first["a"].prompt_logprobs
    assert first["b"].prompt_logprobs is None and len(plp) == len(prompt) and plp[0] is None
    lp = np.asarray(jax.nn.log_softmax(np.asarray(fnx.forward(model, np.asarray([prompt])), np.float32)[0], axis=-1))
    np.testing.assert_allclose([e["logprob"] for e in plp[1:]], [lp[j, prompt[j + 1]] for j in range(36)],
                               rtol=0, atol=1e-5)
    for j in (1, 16, 17, 36):
        ids = [i for i, _ in plp[j]["top"]]
        assert len(ids) == 2 and ids == list(np.argsort(-lp[j - 1], kind="stable")[:2])


@pytest.mark.parametrize("spec", [None, 2])
def test_logit_bias(tiny_models, spec, monkeypatch):
    """`SamplingParams.logit_bias`: +100 on a token makes greedy decoding emit it every step, -100 on what greedy
    picks moves it elsewhere; a row without a bias in the same batch emits what it emits alone (plain and
    speculative: the verify window's positions get the bias too, and so do the drafter's logits, so a biased row
    alone has every draft accepted); the jitted generator applies it as well."""
    model, _ = tiny_models("tiny-c")
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(0, model.cfg.ple_eos_token_id, size=n))) for n in (9, 14)]
    free = fnx.generate(model, prompts, max_new_tokens=6, sampling=SamplingParams(ignore_eos=True))
    from fnx.engine import engine as eng_mod
    eng = Engine(model, max_slots=2, capacity=64, prefill_chunk=16, speculative=spec)
    _run_engine(eng, [(prompts[1], SamplingParams(max_tokens=4, ignore_eos=True))])     # no bias yet
    widths = []                      # per round: the logit-bias width of the round's sampling arrays
    real = eng_mod._jit_spec_round

    def spy(*a, **kw):
        widths.append(a[10].bias_ids.shape[-1])                                 # sp
        return real(*a, **kw)
    monkeypatch.setattr(eng_mod, "_jit_spec_round", spy)
    reqs = [(prompts[0], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((17, 100.0),))),
            (prompts[1], SamplingParams(max_tokens=6, ignore_eos=True))]
    got = _run_engine(eng, reqs)
    assert got["r0"][0] == [17] * 6 and got["r1"][0] == free[1]
    if spec:
        assert any(v > 0 for v in widths), widths
        alone = Engine(model, max_slots=1, capacity=64, prefill_chunk=16, speculative=spec)
        got = _run_engine(alone, [(prompts[1], SamplingParams(max_tokens=9, ignore_eos=True,
                                                              logit_bias=((17, 100.0),)))])
        assert got["r0"][0] == [17] * 9
        assert alone.stats["drafted"] > 0 and alone.stats["accepted"] == alone.stats["drafted"], alone.stats
    banned = tuple((t, -100.0) for t in set(free[0]))
    moved = _run_engine(eng, [(prompts[0], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=banned))])
    assert not set(moved["r0"][0]) & set(free[0])
    gen = jax.jit(fnx.engine.generate_fn(model, 4, SamplingParams(ignore_eos=True, logit_bias=((17, 100.0),))))
    toks, _ = gen(jnp.asarray(prompts[0]), 0)
    assert list(np.asarray(toks)[:4]) == [17] * 4
    with pytest.raises(ValueError, match="logit_bias token ids"):
        eng.submit([1, 2], SamplingParams(logit_bias=((model.cfg.vocab_size, 1.0),)))
    with pytest.raises(ValueError, match="biases in"):
        SamplingParams(logit_bias=((3, 101.0),))


def test_packed_host_rows_unpack_to_the_same_bits():
    """The speculative round's host rows travel as one uint32 array (`pack_host`) and are unpacked on the device
    into their fixed buffers (`_jit_io_put`): every value comes back bit for bit (negative ints, NaN / inf / -0.0
    floats, bools, full-range uint32), whatever the order of the dict's keys; other dtypes are refused."""
    from fnx.engine.engine import _jit_io_put, pack_host
    rng = np.random.default_rng(0)
    f = rng.standard_normal((3, 2, 5)).astype(np.float32)
    f[0, 0, :3] = [np.nan, np.inf, -0.0]
    host = {"z": f, "a": rng.integers(-2**31, 2**31, (3, 2)).astype(np.int32),
            "m": np.array([True, False, True]), "u": np.array([0, 2**32 - 1, 7], np.uint32)}
    dst = jax.device_put({k: np.zeros(v.shape, v.dtype) for k, v in host.items()})
    packed = pack_host(host)
    assert packed.dtype == np.uint32 and packed.shape == (3, 10 + 2 + 1 + 1)
    got = jax.device_get(_jit_io_put(dst, packed))
    for k, v in host.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert np.array_equal(np.asarray(got[k]).view(np.uint8), v.view(np.uint8)), k
    with pytest.raises(TypeError, match="4-byte or bool"):
        pack_host({"h": np.zeros((3, 2), np.float16)})


@pytest.mark.parametrize("overlap", [False, True])
def test_idle_steps_prefill_with_the_idle_budget(tiny_models, overlap):
    """prefill_chunk_idle: a prompt prefills in chunks of the idle budget while no request is decoding (nothing
    waits behind the longer chunk), and in chunks of prefill_chunk while one is; the same tokens as an engine
    without it. Chunks pad to the buckets of both budgets; a budget below prefill_chunk is refused."""
    model, _ = tiny_models("tiny-a")
    rng = np.random.default_rng(11)
    a, b = (list(map(int, rng.integers(0, 250, size=n))) for n in (40, 20))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for idle in (None, 32):
        eng = Engine(model, max_slots=2, capacity=128, prefill_chunk=8, prefill_chunk_idle=idle, overlap=overlap)
        chunks, orig = [], eng._prefill_chunk

        def spy(req, budget, orig=orig, chunks=chunks):
            before = req.prefilled
            out = orig(req, budget)
            chunks.append((req.id, req.prefilled - before, budget))
            return out
        eng._prefill_chunk = spy
        toks = {"a": [], "b": []}
        eng.submit(a, params, request_id="a")
        while not toks["a"]:                     # a alone: prefilled in idle steps
            for o in eng.step():
                toks[o.request_id] += o.token_ids
        eng.submit(b, params, request_id="b")    # b while a decodes
        while eng.has_work():
            for o in eng.step():
                toks[o.request_id] += o.token_ids
        runs[idle] = toks
        if idle is None:
            assert [n for r, n, _ in chunks if r == "a"] == [8] * 5 and [n for r, n, _ in chunks if r == "b"] == [
                8, 8, 4]
        else:
            assert [(n, bud) for r, n, bud in chunks if r == "a"] == [(32, 32), (8, 32)]
            assert [(n, bud) for r, n, bud in chunks if r == "b"] == [(8, 8), (8, 8), (4, 8)]
            assert eng.prefill_buckets() == [8, 16, 32]
            assert [eng.prefill_bucket(n) for n in (4, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    assert runs[None] == runs[32] and len(runs[32]["a"]) == len(runs[32]["b"]) == 12
    with pytest.raises(ValueError, match="prefill_chunk_idle .4. must be at least prefill_chunk .8."):
        Engine(model, max_slots=1, capacity=64, prefill_chunk=8, prefill_chunk_idle=4)
