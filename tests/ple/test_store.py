import os
import time

import ml_dtypes
import numpy as np
import pytest

from fnx.ple import initial_context, ngram_ids
from fnx.ple.store import MODES, PleFetchError, open_store
from fnx.ple.table import TableError, convert_to_raw, from_raw, open_source, validate
from tests.ple.conftest import reference_rows, write_checkpoint_table


def _ids(consts, seed, batch=3, length=9):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, (batch, length))
    tokens[rng.random(tokens.shape) < 0.2] = consts.eos_token_id
    ids, _ = ngram_ids(initial_context(batch, consts), tokens, consts)
    return ids.reshape(-1, consts.num_heads)


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def table(request, tmp_path_factory, consts):
    root = tmp_path_factory.mktemp(request.param)
    table, scale = write_checkpoint_table(root / "ckpt", consts, request.param)
    raw = convert_to_raw(validate(open_source(root / "ckpt", 1), consts), root / "table.raw", consts)
    return dict(dtype=request.param, table=table, scale=scale, ckpt=root / "ckpt", raw=root / "table.raw",
                fingerprint=raw.fingerprint)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["ckpt", "raw"])
def test_every_mode_returns_the_reference_rows(table, consts, mode, layout):
    ids = _ids(consts, seed=1)
    ids[0] = 0  # first and last rows of the table
    ids[1] = consts.num_rows - 1
    want = reference_rows(table["table"], table["scale"], ids)
    with open_store(table[layout], mode, consts=consts, layer=1,
                    expected_fingerprint=table["fingerprint"]) as store:
        assert store.fingerprint == table["fingerprint"]
        store.prefetch(ids)
        for _ in range(2):  # cold, then whatever the mode cached
            got = store.rows(ids.astype(np.int32))
            assert got.dtype == ml_dtypes.bfloat16 and got.shape == (len(ids), 4 * 24)
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        fetch = store.fetch(ids)
        assert not fetch.missing.any() and fetch.error is None
        assert store.stats["fetches"] == 3 and store.stats["missing_rows"] == 0
        empty = store.rows(np.zeros((0, 4), np.int64))
        assert empty.shape == (0, 96)


def test_fp8_dequantization_matches_torch(table, consts):
    if table["dtype"] != "fp8":
        pytest.skip("FP8 only")
    torch = pytest.importorskip("torch")
    ids = _ids(consts, seed=2)
    weight = torch.from_numpy(table["table"].view(np.uint8)).view(torch.float8_e4m3fn)
    scale = torch.tensor(table["scale"].astype(np.float32)).to(torch.bfloat16)
    ref = (weight[torch.from_numpy(ids.reshape(-1))].to(scale.dtype) * scale).reshape(len(ids), -1)
    with open_store(table["raw"], "pageable", consts=consts) as store:
        got = store.rows(ids)
    np.testing.assert_array_equal(got.view(np.uint16), ref.view(torch.int16).numpy().view(np.uint16))


def test_rejects_bad_ids(table, consts):
    with open_store(table["raw"], "pageable", consts=consts) as store:
        with pytest.raises(ValueError, match=r"ids must lie in \[0, 4048\)"):
            store.rows(np.array([[0, 1, 2, 4048]]))
        with pytest.raises(ValueError, match=r"shaped \[N, 4\]"):
            store.rows(np.array([[0, 1, 2]]))
        with pytest.raises(ValueError, match="integers"):
            store.rows(np.zeros((1, 4), np.float32))
    with pytest.raises(RuntimeError, match="closed"):
        store.rows(np.zeros((1, 4), np.int64))
    with pytest.raises(ValueError, match="mode must be one of"):
        open_store(table["raw"], "gpu", consts=consts)
    with pytest.raises(ValueError, match="policy"):
        open_store(table["raw"], "pageable", consts=consts, policy="ignore")


# Start-up validation


def test_validation_rejects_mismatches(tmp_path, consts):
    from fnx.ple import NgramConstants
    from tests.ple.conftest import CONSTS_ARGS

    write_checkpoint_table(tmp_path / "ok", consts, "fp8")
    other_seed = NgramConstants.build(**{**CONSTS_ARGS, "seed": 4})
    with pytest.raises(TableError, match="stored layer_multipliers"):
        open_store(tmp_path / "ok", "pageable", consts=other_seed, layer=1)
    other_rows = NgramConstants.build(**{**CONSTS_ARGS, "ngram_vocab_size_base": 2000})
    with pytest.raises(TableError, match="needs 8"):
        open_store(tmp_path / "ok", "pageable", consts=other_rows, layer=1)
    with pytest.raises(TableError, match="fingerprint .* != the expected 0123"):
        open_store(tmp_path / "ok", "pageable", consts=consts, expected_fingerprint="0123")
    with pytest.raises(TableError, match="no n-gram table for layer 2"):
        open_store(tmp_path / "ok", "pageable", consts=consts, layer=2)

    # FP8 without its scale; a non-positive scale; a missing shard.
    write_checkpoint_table(tmp_path / "noscale", consts, "fp8", with_scale=False)
    with pytest.raises(TableError, match="without .*weight_scale"):
        open_store(tmp_path / "noscale", "pageable", consts=consts)
    src = open_source(tmp_path / "ok", 1)
    src.scale = np.array(-1.0, dtype=ml_dtypes.bfloat16)
    with pytest.raises(TableError, match="finite and positive"):
        validate(src, consts)
    os.remove(sorted((tmp_path / "ok").glob("*.safetensors"))[1])
    with pytest.raises(TableError, match="not a complete 0..N-1 range"):
        open_source(tmp_path / "ok", 1)


def test_raw_file_corruption_is_detected(table, consts, tmp_path):
    data = bytearray(open(table["raw"], "rb").read())
    data[4096 + 5] ^= 0xFF  # row 0 is one of the fingerprint's samples
    (tmp_path / "bad.raw").write_bytes(bytes(data))
    with pytest.raises(TableError, match="modified or corrupted"):
        open_store(tmp_path / "bad.raw", "pageable", consts=consts)
    (tmp_path / "junk.raw").write_bytes(b"NOTATABLE" + bytes(100))
    with pytest.raises(TableError, match="magic"):
        from_raw(tmp_path / "junk.raw")


# Fault injection


@pytest.mark.parametrize("layout", ["ckpt", "raw"])
def test_truncated_file_is_refused_at_open(table, consts, tmp_path, layout):
    import shutil
    if layout == "raw":
        path = tmp_path / "t.raw"
        shutil.copy(table["raw"], path)
        os.truncate(path, os.path.getsize(path) - 1)
        match = "truncated"
    else:
        path = tmp_path / "ckpt"
        shutil.copytree(table["ckpt"], path)
        f = sorted(path.glob("*.safetensors"))[0]
        os.truncate(f, os.path.getsize(f) - 100)
        match = "truncated"
    for mode in MODES:
        with pytest.raises(TableError, match=match):
            open_store(path, mode, consts=consts, layer=1)


@pytest.mark.parametrize("mode", ["pageable", "direct"])
@pytest.mark.parametrize("policy", ["fail", "degrade"])
def test_pages_lost_after_open_give_zero_rows_not_sigbus(table, consts, tmp_path, mode, policy):
    """The file is cut short while the store has it open: reads of the lost pages fail (MADV_POPULATE_READ
    returns EFAULT, pread comes back short); those rows are zero-filled and flagged, the rest are exact."""
    import shutil
    path = tmp_path / "t.raw"
    shutil.copy(table["raw"], path)
    store = open_store(path, mode, consts=consts, policy=policy)
    ids = _ids(consts, seed=5, batch=4, length=8)
    keep = 4096 + (consts.num_rows // 2) * store.src.row_bytes
    keep = keep // 8192 * 8192
    os.truncate(path, keep)
    lost_row = (keep - 4096) // store.src.row_bytes + 1  # wholly past the new end of file
    ids[0, :] = lost_row
    ids[1, :] = 3
    fetch = store.fetch(ids)
    want = reference_rows(table["table"], table["scale"], ids)
    good_tok = ~fetch.missing
    assert fetch.missing[0] and not fetch.missing[1]
    assert not np.any(fetch.rows[0].astype(np.float32))
    np.testing.assert_array_equal(fetch.rows[good_tok].view(np.uint16), want[good_tok].view(np.uint16))
    assert isinstance(fetch.error, PleFetchError)
    stats = store.stats
    assert stats["missing_rows"] >= 1 and stats["flagged_tokens"] == int(fetch.missing.sum())
    assert stats["io_errors"] == 1
    if policy == "fail":
        with pytest.raises(PleFetchError, match="earlier PLE fetch failed"):
            store.rows(ids[1:2])
        np.testing.assert_array_equal(store.rows(ids[1:2]).view(np.uint16), want[1:2].view(np.uint16))
    else:
        np.testing.assert_array_equal(store.rows(ids[1:2]).view(np.uint16), want[1:2].view(np.uint16))
        assert store.last_error is fetch.error
    store.close()


@pytest.mark.parametrize("policy", ["fail", "degrade"])
def test_fetch_past_its_deadline_is_zero_filled(table, consts, policy):
    # a deadline that an ordinary read meets on a loaded CI machine too, and a read stuck far past it
    store = open_store(table["raw"], "pageable", consts=consts, policy=policy, deadline_s=0.3)
    ids = _ids(consts, seed=6)
    want = reference_rows(table["table"], table["scale"], ids)
    np.testing.assert_array_equal(store.rows(ids).view(np.uint16), want.view(np.uint16))
    slow = store._gather
    store._gather = lambda uniq: (time.sleep(2.5), slow(uniq))[1]
    start = time.perf_counter()
    fetch = store.fetch(ids)
    assert time.perf_counter() - start < 2.0
    assert fetch.missing.all() and not np.any(fetch.rows.astype(np.float32))
    assert "deadline" in str(fetch.error) and store.stats["deadline_misses"] == 1
    store._gather = slow
    if policy == "fail":
        with pytest.raises(PleFetchError, match="deadline"):
            store.rows(ids)
    np.testing.assert_array_equal(store.rows(ids).view(np.uint16), want.view(np.uint16))
    store.close()


def test_process_madvise_fallback_is_logged_once(table, consts, caplog, monkeypatch):
    from fnx.ple import _linux as lx
    monkeypatch.setattr(lx, "SYS_PROCESS_MADVISE", 100000)  # an unknown syscall: ENOSYS
    monkeypatch.setattr(lx, "_once", set())
    ids = _ids(consts, seed=7)
    want = reference_rows(table["table"], table["scale"], ids)
    with caplog.at_level("WARNING", logger="fnx.ple"):
        with open_store(table["raw"], "pageable", consts=consts) as store:
            for _ in range(3):
                store.prefetch(ids)
                np.testing.assert_array_equal(store.rows(ids).view(np.uint16), want.view(np.uint16))
            assert not store._advisor.batched
    assert sum("process_madvise is unavailable" in r.message for r in caplog.records) == 1


def test_evict_of_given_rows_drops_only_their_pages(table, consts):
    """`evict(ids)` (the benchmarks' cold fetches) drops the page-cache pages of those rows and no others; the
    rows read back unchanged afterwards."""
    from fnx.ple import _linux as lx
    with open_store(table["raw"], "pageable", consts=consts) as store:
        fd, base, size = next(iter(store._maps.values()))
        os.fsync(fd)    # the table was just written: dirty pages are not dropped
        store.evict()   # and its pages sit in large folios from the write; faulted back in below, page by page
        if lx.resident(base, size).any():
            pytest.skip("this filesystem keeps the table's pages after POSIX_FADV_DONTNEED")
        e, rb = store.src.extents[0], store.src.row_bytes
        pages = lambda ids: np.unique((e.offset + np.unique(ids) * rb) // lx.PAGE)  # noqa: E731
        ids, other = _ids(consts, seed=4, batch=1, length=2), _ids(consts, seed=5, batch=1, length=2)
        want = store.rows(ids)
        store.rows(other)
        mine, theirs = pages(ids), np.setdiff1d(pages(other), pages(ids) + np.array([[-1], [0], [1]]))
        assert len(theirs) and lx.resident(base, size)[mine].all()
        store.evict(ids)
        res = lx.resident(base, size)
        assert not res[mine].any() and res[theirs].all()
        np.testing.assert_array_equal(store.rows(ids).view(np.uint16), want.view(np.uint16))


def test_page_ranges_small_and_vectorised_agree(monkeypatch):
    """page_ranges in Python ints (up to SMALL_RANGES offsets, a decode fetch) and vectorised: the same ranges in
    the same order and the same mapping, for sorted and unsorted offsets, rows crossing pages, shared pages."""
    from fnx.ple import _linux as lx
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(1, lx.SMALL_RANGES + 1))
        length = int(rng.choice([1, 160, lx.PAGE, lx.PAGE + 100]))
        base = int(rng.integers(0, 3)) * lx.PAGE + int(rng.integers(0, 100))
        offs = rng.integers(0, int(rng.choice([5_000, 10**6, 10**10])), size=n).astype(np.int64)
        if trial % 2:
            offs = np.sort(offs)
        small = lx.page_ranges(base, offs, length)
        monkeypatch.setattr(lx, "SMALL_RANGES", 0)
        vec = lx.page_ranges(base, offs, length)
        monkeypatch.undo()
        assert small[0].dtype == vec[0].dtype == np.uint64 and small[0].shape == vec[0].shape
        np.testing.assert_array_equal(small[0], vec[0])
        np.testing.assert_array_equal(small[1], vec[1])
        assert (small[0][small[1], 0] <= (base + offs) // lx.PAGE * lx.PAGE).all()   # each row's page is covered


def test_unique_rows_small_path_equals_numpy():
    """A fetch's unique rows in Python ints (up to SMALL_UNIQUE ids, a decode step) and through np.unique: the same
    sorted values and the same inverse, with duplicates, one id, none, and past the threshold."""
    from fnx.ple import store as ps
    rng = np.random.default_rng(5)
    for n in (0, 1, 2, 16, 80, ps.SMALL_UNIQUE, ps.SMALL_UNIQUE + 1, 500):
        for hi in (3, 10**9):
            flat = rng.integers(0, hi, size=n).astype(np.int64)
            got = ps._unique_inverse(flat)
            want = np.unique(flat, return_inverse=True)
            assert got[0].dtype == np.int64
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1].reshape(-1))
            np.testing.assert_array_equal(got[0][got[1]], flat)


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
@pytest.mark.parametrize("layout", ["ckpt", "raw"])
def test_uva_store_gathers_rows_on_the_device(table, consts, layout, impl, monkeypatch):
    """`uva` mode: the table in pinned chunks (small ones here: several per file), the rows gathered inside a jit
    by the UVA kernel's addressing (on the CPU over a stand-in copy of the chunks, `emulate=True`), dequantized as
    the device mode: the reference rows bit for bit, the same as its host gather; the table handle is a pytree
    that passes through jit. Without emulation a CPU cannot run the kernel, and says so."""
    import jax
    import jax.numpy as jnp

    from fnx.ple.store import UvaStore
    monkeypatch.setattr(UvaStore, "chunk_bytes", 1000)
    ids = _ids(consts, seed=3)
    ids[0], ids[1] = 0, consts.num_rows - 1
    want = reference_rows(table["table"], table["scale"], ids)
    with open_store(table[layout], "uva", consts=consts, layer=1, emulate=True, impl=impl) as store:
        assert len(store.table.starts) > 4                      # the rows span many chunks
        got = np.asarray(store.rows_device(ids.reshape(3, 9, 4)))
        assert got.shape == (3, 9, 96) and got.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got.reshape(len(ids), -1).view(np.uint16), want.view(np.uint16))
        np.testing.assert_array_equal(store.rows(ids).view(np.uint16), want.view(np.uint16))
        inside = jax.jit(lambda t, i: t.gather(i) * 2)(store.table, jnp.asarray(ids, jnp.int32))
        np.testing.assert_array_equal(np.asarray(inside), np.asarray(want.astype(np.float32) * 2, ml_dtypes.bfloat16))
        assert not store.device_path                        # emulated: the rows come from a device copy
    if jax.default_backend() != "gpu":
        with open_store(table[layout], "uva", consts=consts, layer=1) as store:
            assert not store.device_path                    # the kernel cannot run on this machine
            with pytest.raises(RuntimeError, match="cannot run here"):
                store.rows_device(ids)


@pytest.mark.gpu
def test_uva_store_reads_pinned_memory_on_the_gpu(table, consts):
    """On a GPU: the kernel reads the rows from the pinned chunks through their host addresses."""
    ids = _ids(consts, seed=4)
    want = reference_rows(table["table"], table["scale"], ids)
    with open_store(table["raw"], "uva", consts=consts, layer=1) as store:
        got = np.asarray(store.rows_device(ids))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_uva_store_checks_its_device_reads_at_start(table, consts, monkeypatch):
    """At start-up a uva store reads every chunk's first and last row through the device path and compares them
    with the table's bytes: a device that reads something else (here: the stand-in addresses off by one row) is a
    TableError naming the modes that work, never wrong rows later."""
    from fnx.pallas.uva_gather import api
    from fnx.ple.store import TableError, UvaStore
    monkeypatch.setattr(UvaStore, "chunk_bytes", 1000)
    real = api.gather_words
    monkeypatch.setattr(api, "gather_words", lambda ids, *a, **k: real(ids + 1, *a, **k))
    with pytest.raises(TableError, match="use pinned or pageable"):
        open_store(table["raw"], "uva", consts=consts, layer=1, emulate=True)
