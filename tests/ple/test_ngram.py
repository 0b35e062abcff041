import numpy as np
import pytest

from fnx.ple import NgramConstants, initial_context, ngram_ids

RELEASE_EOS = 248044

RELEASE_HEAD_VOCAB_SIZES = [
    20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077,
    20000081, 20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171,
]
RELEASE_HEAD_OFFSETS = [
    0, 20000003, 40000026, 60000059, 80000106, 100000165, 120000228, 140000297,
    160000374, 180000455, 200000548, 220000655, 240000802, 260000955, 280001114, 300001275,
]
RELEASE_SEQUENCE = [9707, 11, 1879, RELEASE_EOS, 785]
RELEASE_IDS = [
    [16410909, 39682429, 55103279, 60931720, 87006904, 116506179, 131512017, 152932897,
     169641436, 182022480, 209277433, 237891023, 256841529, 277007269, 290665954, 300984276],
    [18158303, 36390029, 45652312, 70783524, 98191154, 114024957, 127804916, 159566246,
     175132467, 192583600, 217919476, 237199054, 259336807, 261799367, 289359313, 307699687],
    [6380558, 26411572, 56460672, 78566983, 94693008, 106742196, 124822692, 148942556,
     164226950, 190352573, 210933682, 238908951, 242182004, 265475238, 299910982, 312121804],
    [18827606, 27700912, 56521518, 65780303, 81132822, 100518937, 120474864, 142052741,
     163793416, 184135950, 219854666, 227756662, 248975183, 271245822, 285569892, 318943450],
    [15577408, 34921626, 48348615, 67351853, 98974017, 103649092, 121412708, 153166043,
     170379721, 190482408, 216815870, 231783156, 244739733, 278925539, 283927216, 310984051],
]


@pytest.fixture(scope="module")
def release():
    return NgramConstants.build(248320, 3, 8, 20_000_000, 128, 1234, 0, RELEASE_EOS)


def _random_tokens(rng, batch, length, vocab, eos):
    """Random ids with eos sprinkled in, including runs and both ends."""
    tokens = rng.integers(0, vocab, size=(batch, length), dtype=np.int64)
    tokens[rng.random((batch, length)) < 0.2] = eos
    if length >= 4:
        tokens[0, 0] = eos
        tokens[0, -1] = eos
        tokens[-1, 1:3] = eos
    return tokens


def _full_in_chunks(context, tokens, consts, cuts):
    pieces, ctx = [], context
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        ids, ctx = ngram_ids(ctx, tokens[:, lo:hi], consts)
        pieces.append(ids)
    return np.concatenate(pieces, axis=1), ctx


# Release constants and spec test vector


def test_release_constants(release):
    assert release.multipliers.dtype == np.int64
    assert release.multipliers.tolist() == [23703573157769, 20109073645365, 8052911324071]
    assert release.head_vocab_sizes.tolist() == RELEASE_HEAD_VOCAB_SIZES
    assert release.head_offsets.tolist() == RELEASE_HEAD_OFFSETS
    assert release.num_rows == 320_001_536
    assert release.num_heads == 16
    assert (release.ngram_size, release.heads_per_ngram, release.eos_token_id) == (3, 8, RELEASE_EOS)


def test_release_constants_build_fast():
    import time

    start = time.perf_counter()
    NgramConstants.build(248320, 3, 8, 20_000_000, 128, 1234, 1, RELEASE_EOS)
    assert time.perf_counter() - start < 0.5


def test_from_config_matches_build(release):
    class Cfg:
        vocab_size = 248320
        ngram_size = 3
        heads_per_ngram = 8
        ngram_vocab_size_base = 20_000_000
        make_ngram_vocab_size_divisible_by = 128
        seed = 1234
        eos_token_id = [RELEASE_EOS, 248046]

    consts = NgramConstants.from_config(Cfg())
    for name in ("multipliers", "head_vocab_sizes", "head_offsets"):
        np.testing.assert_array_equal(getattr(consts, name), getattr(release, name))
    assert consts.num_rows == release.num_rows
    assert consts.eos_token_id == RELEASE_EOS
    Cfg.eos_token_id = RELEASE_EOS
    assert NgramConstants.from_config(Cfg()).eos_token_id == RELEASE_EOS


def test_release_test_vector(release):
    tokens = np.array([RELEASE_SEQUENCE])
    ids, ctx = ngram_ids(initial_context(1, release), tokens, release)
    assert ids.dtype == np.int64 and ids.shape == (1, 5, 16)
    assert ids[0].tolist() == RELEASE_IDS
    assert ctx.tolist() == [[RELEASE_EOS, 785]]
    assert ids.min() >= 0 and ids.max() < release.num_rows


def test_release_test_vector_token_by_token(release):
    ctx = initial_context(1, release)
    rows = []
    for token in RELEASE_SEQUENCE:
        ids, ctx = ngram_ids(ctx, np.array([[token]]), release)
        rows.append(ids[0, 0].tolist())
    assert rows == RELEASE_IDS
    # The token after an EOS hashes exactly like a sequence start.
    fresh, _ = ngram_ids(initial_context(1, release), np.array([[785]]), release)
    assert fresh[0, 0].tolist() == RELEASE_IDS[-1]


# Incremental calls


@pytest.mark.parametrize("ngram_size,heads_per_ngram", [(2, 1), (3, 2), (3, 8), (4, 3), (5, 2)])
def test_incremental_matches_full(ngram_size, heads_per_ngram):
    vocab, eos = 500, 17
    consts = NgramConstants.build(vocab, ngram_size, heads_per_ngram, 1000, 64, 7, 0, eos)
    rng = np.random.default_rng(ngram_size * 10 + heads_per_ngram)
    for trial in range(20):
        length = int(rng.integers(1, 40))
        tokens = _random_tokens(rng, 2, length, vocab, eos)
        full, full_ctx = ngram_ids(initial_context(2, consts), tokens, consts)
        assert full.shape == (2, length, consts.num_heads)
        # Random cut points, plus one-token chunks and chunks shorter than n-1.
        inner = rng.choice(np.arange(1, length), size=min(length - 1, int(rng.integers(0, 6))), replace=False)
        cut_sets = [
            [0, *sorted(inner.tolist()), length],
            list(range(length + 1)),
            sorted({0, length, *range(0, length, max(1, ngram_size - 2))}),
        ]
        for cuts in cut_sets:
            chunked, ctx = _full_in_chunks(initial_context(2, consts), tokens, consts, cuts)
            np.testing.assert_array_equal(chunked, full)
            np.testing.assert_array_equal(ctx, full_ctx)


def test_batch_rows_are_independent(release):
    rng = np.random.default_rng(0)
    tokens = _random_tokens(rng, 2, 12, 248320, RELEASE_EOS)
    both, _ = ngram_ids(initial_context(2, release), tokens, release)
    for b in range(2):
        one, _ = ngram_ids(initial_context(1, release), tokens[b : b + 1], release)
        np.testing.assert_array_equal(both[b : b + 1], one)
    assert not np.array_equal(both[0], both[1])


def test_short_call_context_keeps_older_tokens():
    consts = NgramConstants.build(100, 4, 1, 50, 1, 0, 0, 99)
    ctx = np.array([[1, 2, 3]])
    _, ctx = ngram_ids(ctx, np.array([[4]]), consts)
    assert ctx.tolist() == [[2, 3, 4]]
    ids, ctx2 = ngram_ids(ctx, np.zeros((1, 0), dtype=np.int64), consts)
    assert ids.shape == (1, 0, 3) and ctx2.tolist() == [[2, 3, 4]]


def test_ids_stay_in_their_head_ranges():
    consts = NgramConstants.build(1000, 4, 3, 200, 128, 5, 2, 0)
    rng = np.random.default_rng(3)
    tokens = _random_tokens(rng, 3, 64, 1000, 0)
    tokens[1, 5] = 999
    ids, _ = ngram_ids(initial_context(3, consts), tokens, consts)
    lo = consts.head_offsets
    hi = consts.head_offsets + consts.head_vocab_sizes
    assert np.all((ids >= lo) & (ids < hi))
    assert hi[-1] <= consts.num_rows and consts.num_rows % 128 == 0


# Comparison with the transformers reference


def _reference(ngram_size, heads_per_ngram, ple_layer_index, eos, seed):
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    num_heads = (ngram_size - 1) * heads_per_ngram
    cfg = Qwen4ExpTextConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=4,
        ple_layer_ids=[1],
        ple_embed_dim=num_heads,
        ngram_size=ngram_size,
        heads_per_ngram=heads_per_ngram,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=16,
        seed=seed,
        eos_token_id=[eos, eos + 1],
    )
    module = modeling.Qwen4ExpTextNGramEmbedding(cfg, num_heads, layer_idx=0, ple_layer_index=ple_layer_index)
    # One float64 column holding each row's own index turns the lookup into the ids.
    rows = module.ngram_embedding.weight.shape[0]
    module.ngram_embedding.weight.data = torch.arange(rows, dtype=torch.float64)[:, None]
    return torch, cfg, module


def _reference_ids(torch, module, tokens, cache=None):
    with torch.no_grad():
        out = module(torch.from_numpy(tokens), cache)
    return out.numpy().astype(np.int64)


REFERENCE_CASES = [
    (n, h, p) for n in (2, 3, 4) for h in (1, 2, 3) for p in (0, 1)
]


@pytest.mark.parametrize("ngram_size,heads_per_ngram,ple_layer_index", REFERENCE_CASES)
def test_matches_reference(ngram_size, heads_per_ngram, ple_layer_index):
    eos = 5
    torch, cfg, module = _reference(ngram_size, heads_per_ngram, ple_layer_index, eos, seed=1234 + ngram_size)
    consts = NgramConstants.from_config(cfg, ple_layer_index=ple_layer_index)

    assert consts.multipliers.tolist() == module.layer_multipliers.tolist()
    assert consts.head_vocab_sizes.tolist() == module.ngram_heads_vocab_sizes.tolist()
    assert consts.head_offsets.tolist() == module.ngram_heads_offsets.tolist()
    assert consts.num_rows == module.ngram_embedding.weight.shape[0]

    rng = np.random.default_rng(100 * ngram_size + 10 * heads_per_ngram + ple_layer_index)
    for length in (1, 2, 3, 7, 33):
        tokens = _random_tokens(rng, 3, length, 1000, eos)
        ours, _ = ngram_ids(initial_context(3, consts), tokens, consts)
        np.testing.assert_array_equal(ours, _reference_ids(torch, module, tokens))


@pytest.mark.parametrize("ngram_size,heads_per_ngram", [(2, 2), (3, 2), (4, 1), (4, 3)])
def test_matches_reference_with_cache(ngram_size, heads_per_ngram):
    from transformers import DynamicCache

    eos = 9
    torch, cfg, module = _reference(ngram_size, heads_per_ngram, 0, eos, seed=42)
    consts = NgramConstants.from_config(cfg)
    rng = np.random.default_rng(ngram_size + 7 * heads_per_ngram)
    for trial in range(4):
        tokens = _random_tokens(rng, 2, 24, 1000, eos)
        cuts = [0, 1, 3, 4, 10, 11, 12, 20, 24] if trial % 2 else [0, 9, 10, 11, 13, 24]
        cache = DynamicCache(config=cfg)
        ctx = initial_context(2, consts)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            ours, ctx = ngram_ids(ctx, tokens[:, lo:hi], consts)
            np.testing.assert_array_equal(ours, _reference_ids(torch, module, tokens[:, lo:hi], cache))
            np.testing.assert_array_equal(ctx, cache.get_conv_state(0, state_idx=2).numpy())


# Input validation


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"ngram_size": 1}, "ngram_size"),
        ({"heads_per_ngram": 0}, "heads_per_ngram"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"ngram_vocab_size_base": 0}, "ngram_vocab_size_base"),
        ({"vocab_divisor": 0}, "vocab_divisor"),
        ({"ple_layer_index": -1}, "ple_layer_index"),
        ({"eos_token_id": -1}, "eos_token_id"),
        ({"eos_token_id": 100}, "eos_token_id"),
        ({"ngram_size": 3.0}, "ngram_size"),
        ({"seed": True}, "seed"),
    ],
)
def test_build_rejects_bad_arguments(kwargs, field):
    args = dict(vocab_size=100, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50,
                vocab_divisor=8, seed=1, ple_layer_index=0, eos_token_id=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        NgramConstants.build(**args)


def test_from_config_rejects_missing_eos():
    class Cfg:
        vocab_size = 100
        ngram_size = 3
        heads_per_ngram = 2
        ngram_vocab_size_base = 50
        make_ngram_vocab_size_divisible_by = 8
        seed = 1
        eos_token_id = None

    with pytest.raises(ValueError, match="eos_token_id"):
        NgramConstants.from_config(Cfg())
    Cfg.eos_token_id = []
    with pytest.raises(ValueError, match="eos_token_id"):
        NgramConstants.from_config(Cfg())


def test_ngram_ids_rejects_bad_inputs():
    consts = NgramConstants.build(100, 3, 2, 50, 8, 1, 0, 3)
    ctx = initial_context(2, consts)
    good = np.array([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        ngram_ids(ctx, good.astype(np.float32), consts)
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        ngram_ids(ctx, good > 2, consts)
    with pytest.raises(ValueError, match="tokens must have 2 dims"):
        ngram_ids(ctx, good[0], consts)
    with pytest.raises(ValueError, match="non-negative"):
        ngram_ids(ctx, np.array([[1, -2], [3, 4]]), consts)
    with pytest.raises(ValueError, match="allowed maximum 99"):
        ngram_ids(ctx, np.array([[1, 100], [3, 4]]), consts, vocab_size=100)
    with pytest.raises(ValueError, match="allowed maximum"):
        ngram_ids(ctx, np.array([[1, 2**63]], dtype=np.uint64), consts)
    with pytest.raises(ValueError, match=r"context must have shape \[B, 2\]"):
        ngram_ids(np.full((2, 3), 3), good, consts)
    with pytest.raises(ValueError, match="context must be an integer array"):
        ngram_ids(ctx.astype(np.float64), good, consts)
    with pytest.raises(ValueError, match="batch"):
        ngram_ids(initial_context(3, consts), good, consts)
    with pytest.raises(ValueError, match="batch"):
        initial_context(0, consts)
    # uint32 / int32 inputs are accepted and give the same ids.
    ref, _ = ngram_ids(ctx, good, consts)
    np.testing.assert_array_equal(ngram_ids(ctx.astype(np.int32), good.astype(np.uint32), consts)[0], ref)


def test_constants_are_read_only(release):
    with pytest.raises(ValueError):
        release.multipliers[0] = 1
    with pytest.raises(AttributeError):
        release.ngram_size = 4


# Rollback after a partially accepted verify window


def _mtp_decode(consts, rng, batch, steps, k, vocab, eos, first):
    """Simulate MTP rounds: each row hashes a window [next, k drafts], keeps a random prefix, rolls back.

    Returns the accepted stream [B, T] and the ids the rounds produced for the accepted tokens [B, T, H]."""
    from fnx.ple import context_after

    ctx = initial_context(batch, consts)
    ids, ctx = ngram_ids(ctx, first, consts)
    accepted = [[*row] for row in first.tolist()]
    got = [[*r] for r in ids]
    for _ in range(steps):
        window = _random_tokens(rng, batch, k + 1, vocab, eos)
        n_acc = rng.integers(0, k + 2, size=batch)
        win_ids, full_ctx = ngram_ids(ctx, window, consts)
        new_ctx = context_after(ctx, window, n_acc, consts)
        for b in range(batch):
            a = int(n_acc[b])
            accepted[b] += window[b, :a].tolist()
            got[b] += list(win_ids[b, :a])
            # Same as re-hashing only the accepted prefix.
            _, ref_ctx = ngram_ids(ctx[b : b + 1], window[b : b + 1, :a], consts)
            np.testing.assert_array_equal(new_ctx[b], ref_ctx[0])
        np.testing.assert_array_equal(context_after(ctx, window, k + 1, consts), full_ctx)
        np.testing.assert_array_equal(context_after(ctx, window, 0, consts), ctx)
        ctx = new_ctx
    return accepted, got


@pytest.mark.parametrize("ngram_size,heads_per_ngram", [(2, 2), (3, 2), (4, 1)])
def test_rollback_matches_reference(ngram_size, heads_per_ngram):
    eos = 5
    torch, cfg, module = _reference(ngram_size, heads_per_ngram, 0, eos, seed=99)
    consts = NgramConstants.from_config(cfg)
    rng = np.random.default_rng(ngram_size * 31 + heads_per_ngram)
    first = _random_tokens(rng, 3, 4, 1000, eos)
    accepted, got = _mtp_decode(consts, rng, 3, steps=25, k=3, vocab=1000, eos=eos, first=first)
    for b in range(3):
        stream = np.array([accepted[b]])
        ref = _reference_ids(torch, module, stream)[0]
        np.testing.assert_array_equal(np.array(got[b]), ref)


def test_rollback_release_constants(release):
    rng = np.random.default_rng(11)
    first = _random_tokens(rng, 2, 3, 248320, RELEASE_EOS)
    accepted, got = _mtp_decode(release, rng, 2, steps=40, k=4, vocab=248320, eos=RELEASE_EOS, first=first)
    for b in range(2):
        full, _ = ngram_ids(initial_context(1, release), np.array([accepted[b]]), release)
        np.testing.assert_array_equal(np.array(got[b]), full[0])


def test_context_after_rejects_bad_inputs(release):
    from fnx.ple import context_after

    ctx = initial_context(2, release)
    window = np.array([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match=r"n_accepted must lie in \[0, 3\]"):
        context_after(ctx, window, 4, release)
    with pytest.raises(ValueError, match="n_accepted must lie"):
        context_after(ctx, window, np.array([1, -1]), release)
    with pytest.raises(ValueError, match=r"shaped \[2\]"):
        context_after(ctx, window, np.array([1, 1, 1]), release)
    with pytest.raises(ValueError, match="n_accepted must be integers"):
        context_after(ctx, window, 1.0, release)
    with pytest.raises(ValueError, match="batch"):
        context_after(ctx[:1], window, 1, release)
    assert context_after(ctx, window, np.array([3, 1]), release).tolist() == [[2, 3], [RELEASE_EOS, 4]]


def test_python_and_vectorised_hashing_agree(release, monkeypatch):
    """Calls of up to SMALL_TOKENS tokens hash with Python ints (hash_rows), larger ones vectorised: the same ids
    on random rows with EOS in the context and the tokens, at the release constants (products near 2^63)."""
    from fnx.ple import ngram
    rng = np.random.default_rng(7)
    for batch, length in ((1, 1), (1, 5), (3, 4), (8, 8), (2, 32), (4, 4), (16, 5)):
        ctx = _random_tokens(rng, batch, 2, 248320, RELEASE_EOS)
        tokens = _random_tokens(rng, batch, length, 248320, RELEASE_EOS)
        tokens[:, -1] = 248319                                          # the largest id
        fast, ctx_fast = ngram_ids(ctx, tokens, release)
        monkeypatch.setattr(ngram, "SMALL_TOKENS", 0)
        slow, ctx_slow = ngram_ids(ctx, tokens, release)
        monkeypatch.undo()
        assert fast.dtype == slow.dtype == np.int64 and fast.shape == (batch, length, 16)
        np.testing.assert_array_equal(fast, slow)
        np.testing.assert_array_equal(ctx_fast, ctx_slow)
        rows = np.concatenate([ctx, tokens], axis=1).tolist()
        np.testing.assert_array_equal(ngram.hash_rows(rows, length, release), slow)
