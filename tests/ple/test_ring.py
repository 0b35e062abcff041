"""`ring` mode (fnx.ple.ring): the store's host thread against the device side. On the CPU the device side is
emulated (`emulate=True`: host callbacks that do what the kernels do, over the same control block), so these
tests run the real thread, the real C poll loop, the real backing mmap and the real protocol: seqs, id pairs,
DONE, ABANDONED, deadlines. The kernels themselves: tests/pallas/test_ple_ring.py."""

import shutil
import time
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fnx.pallas.ple_ring import layout
from fnx.ple.ring import RingStore, _native_poll
from fnx.ple.store import PleFetchError, open_store
from tests.ple.conftest import reference_rows, write_checkpoint_table
from tests.ple.test_store import _ids


def slow_host(store, monkeypatch, seconds: float, which: int = 1) -> list:
    """The store's host thread answers its `which`-th request `seconds` late; returns the seqs it served."""
    real, calls = store._serve_one, []

    def slow(seq, start):
        calls.append(seq)
        if len(calls) == which:
            time.sleep(seconds)
        return real(seq, start)

    monkeypatch.setattr(store, "_serve_one", slow)
    return calls


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def table(request, tmp_path_factory, consts):
    root = tmp_path_factory.mktemp(f"ring_{request.param}")
    table, scale = write_checkpoint_table(root / "ckpt", consts, request.param)
    return dict(table=table, scale=scale, ckpt=root / "ckpt")


@pytest.mark.parametrize("backing", ["pageable", "swap", "direct"])
def test_ring_serves_each_request_its_rows(table, consts, backing):
    """Requests of different sizes in turn through one ring (ids repeating, the first and last table rows): each
    gets its own rows, bit for bit as the reference, inside a jit; the seqs grow one per request; the counters
    move; the host interface gives the same rows."""
    with open_store(table["ckpt"], "ring", consts=consts, layer=1, emulate=True, backing=backing,
                    max_ids=256) as store:
        assert isinstance(store, RingStore) and store.host.mode == backing
        assert not store.device_path and not store.host.device_path     # emulated: no page-locked block
        run = jax.jit(lambda t, i: t.gather(i))
        for r, (batch, length) in enumerate([(3, 9), (1, 1), (2, 5), (3, 9)]):
            ids = _ids(consts, seed=10 + r, batch=batch, length=length)
            ids[0] = 0
            ids[-1] = consts.num_rows - 1
            want = reference_rows(table["table"], table["scale"], ids)
            got = np.asarray(run(store.table, jnp.asarray(ids.reshape(batch, length, -1), jnp.int32)))
            assert got.shape == (batch, length, want.shape[1]) and got.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(got.reshape(want.shape).view(np.uint16), want.view(np.uint16))
            assert int(store._done[0]) == r + 1
        np.testing.assert_array_equal(store.rows(ids).view(np.uint16), want.view(np.uint16))
        st = store.stats
        assert st["ring_requests"] == 4 and st["ring_abandoned"] == 0 and st["missing_rows"] == 0
        assert st["ring_rows"] == (27 + 1 + 10 + 27) * consts.num_heads
        if backing == "pageable" and shutil.which("cc"):     # rows straight from the page cache, in C
            assert st["ring_cached_rows"] + st["ring_uncached_rows"] == st["ring_rows"]
            assert st["ring_cached_rows"] > 0
        store.check()


def test_ring_rows_the_page_cache_lacks_take_the_guarded_path(table, consts):
    """The page-cache copy reports some rows as not cached (EAGAIN; their ring slots left zero here): those, and
    only those, are read the backing store's way, and every row of the request is right."""
    import ctypes
    import errno
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: no page-cache copy")
    with open_store(table["ckpt"], "ring", consts=consts, layer=1, emulate=True) as store:
        real = store._serve_c

        def partly(*args):
            got = real(*args)
            n, status = args[1], args[-1]
            st = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(status))
            for i in range(0, n, 3):
                st[i] = errno.EAGAIN
                store._ring[i] = 0
            return got + len(range(0, n, 3))

        store._serve_c = partly
        ids = _ids(consts, seed=9)
        want = reference_rows(table["table"], table["scale"], ids)
        got = np.asarray(store.rows_device(ids))
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        st = store.stats
        assert st["ring_uncached_rows"] == len(range(0, ids.size, 3)) and st["ring_cached_rows"] > 0
        assert st["rows_unique"] > 0                      # the guarded path ran


def test_ring_refuses_a_step_larger_than_the_ring(table, consts):
    for bad, why in [({"backing": "pinned"}, "backing must be one of"), ({"max_ids": 0}, "max_ids must be positive"),
                     ({"gpu_timeout_s": 0}, r"gpu_timeout_s must lie in \(0, 2000\)")]:
        with pytest.raises(ValueError, match=why):
            open_store(table["ckpt"], "ring", consts=consts, layer=1, emulate=True, **bad)
    with open_store(table["ckpt"], "ring", consts=consts, layer=1, emulate=True, max_ids=64) as store:
        ids = jnp.zeros((2, 9, consts.num_heads), jnp.int32)
        with pytest.raises(ValueError, match="exceeds the ring's max_ids=64"):
            jax.jit(lambda t, i: t.gather(i))(store.table, ids)


def test_ring_late_host_gives_zero_rows_then_recovers(table, consts, monkeypatch):
    """The host thread stalls past the GPU's deadline on one request: that step gets zero rows, the request is
    marked ABANDONED and `check()` raises it (policy fail) once; the late answer cannot be mistaken for the next
    request's (a new seq), which gets its own rows."""
    # a GPU deadline an ordinary answer meets on a loaded CI machine too, and a host far past it
    with open_store(table["ckpt"], "ring", consts=consts, layer=1, emulate=True, gpu_timeout_s=0.6) as store:
        calls = slow_host(store, monkeypatch, 1.8)
        run = jax.jit(lambda t, i: t.gather(i))
        ids = _ids(consts, seed=3)
        got = np.asarray(run(store.table, jnp.asarray(ids, jnp.int32)))
        assert not got.any()
        assert int(store._abandoned[0]) == 1
        with pytest.raises(PleFetchError, match="waited 0.6 s for the PLE rows of ring request 1"):
            store.check()
        store.check()                                     # reported once
        time.sleep(2.0)                                   # the late answer lands (DONE = 1)
        ids2 = _ids(consts, seed=4)
        want = reference_rows(table["table"], table["scale"], ids2)
        got = np.asarray(run(store.table, jnp.asarray(ids2, jnp.int32)))
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        assert calls == [1, 2] and store.stats["ring_abandoned"] == 1


def test_ring_torn_ids_are_zero_rows_and_an_error(table, consts):
    """A request whose id pairs never all carry its seq (a torn write): zero rows, the error pending for the next
    check (policy fail); the thread keeps serving the next request."""
    with open_store(table["ckpt"], "ring", consts=consts, layer=1, emulate=True, deadline_s=0.3,
                    gpu_timeout_s=5.0) as store:
        real_pairs, tear = store._emu_pairs, [True]

        def torn(seq, ids):
            real_pairs(seq, ids)
            if tear:                                      # before the header is published: the host thread
                store._pairs[3] = np.uint64(0)            # never sees the whole request (one pair left from before)

        store._emu_pairs = torn
        got = np.asarray(store.rows_device(_ids(consts, seed=5)))
        assert not got.any() and store.stats["ring_torn"] == 1
        with pytest.raises(PleFetchError, match="not all written"):
            store.check()
        tear.clear()
        ids = _ids(consts, seed=6)
        want = reference_rows(table["table"], table["scale"], ids)
        np.testing.assert_array_equal(np.asarray(store.rows_device(ids)).view(np.uint16), want.view(np.uint16))


def test_ring_poll_loop_builds_and_waits():
    """The C poll loop (built with the system compiler): returns as soon as the word changes, and `last` after its
    timeout."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here (the ring's host thread then polls from Python, and logs it)")
    poll = _native_poll()
    assert poll is not None
    word = np.zeros(2, np.uint32)
    addr = word.ctypes.data
    for spin, fast in [(1000, 10_000_000), (0, 0)]:         # spin then 20 us polls; idle 500 us polls
        t0 = time.perf_counter()
        assert poll(addr, 0, spin, fast, 20_000_000) == 0
        assert 0.015 < time.perf_counter() - t0 < 1.0
    word[0] = 7
    assert poll(addr, 0, 1000, 0, 20_000_000) == 7


def test_ring_layout_keeps_the_areas_apart():
    for max_ids, rb in [(1, 4), (512, 160), (65536, 160), (1000, 48)]:
        ro = layout.rows_offset(max_ids)
        assert layout.PAIRS + 8 * max_ids <= ro and ro % layout.PAGE == 0
        assert ro + max_ids * rb <= layout.total_bytes(max_ids, rb)
        assert layout.HEADER + 8 <= layout.DONE and layout.DONE + 8 <= layout.ABANDONED < layout.PAIRS


def test_ring_without_a_gpu_says_so(table, consts):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU runs the kernels")
    with open_store(table["ckpt"], "ring", consts=consts, layer=1) as store:
        ids = _ids(consts, seed=7)
        want = reference_rows(table["table"], table["scale"], ids)
        np.testing.assert_array_equal(store.rows(ids).view(np.uint16), want.view(np.uint16))
        with pytest.raises(RuntimeError, match="cannot run here"):
            store.rows_device(ids)


@pytest.mark.gpu
def test_ring_kernels_with_the_host_thread_on_the_gpu(table, consts, monkeypatch):
    """On a GPU: the post and wait kernels against the store's thread through a real page-locked block. Requests in
    turn, in one program twice (two requests back to back), rows equal to the reference; then a host that answers
    late: the wait kernel's deadline gives zero rows and ABANDONED, and the next request is served."""
    with open_store(table["ckpt"], "ring", consts=consts, layer=1, gpu_timeout_s=0.3) as store:
        assert store.device_path                                # the page-locked control block exists
        for seed in range(3):
            ids = _ids(consts, seed=20 + seed)
            want = reference_rows(table["table"], table["scale"], ids)
            np.testing.assert_array_equal(np.asarray(store.rows_device(ids)).view(np.uint16), want.view(np.uint16))
        a, b = _ids(consts, seed=30), _ids(consts, seed=31, batch=1, length=2)
        two = jax.jit(lambda t, x, y: (t.gather(x), t.gather(y)))(store.table, jnp.asarray(a, jnp.int32),
                                                                  jnp.asarray(b, jnp.int32))
        for got, ids in zip(two, (a, b)):
            want = reference_rows(table["table"], table["scale"], ids)
            np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))
        slow_host(store, monkeypatch, 0.8)
        got = np.asarray(store.rows_device(_ids(consts, seed=40)))
        assert not got.any() and store.stats["ring_abandoned"] == 0   # counted when checked
        with pytest.raises(PleFetchError, match="ring request"):
            store.check()
        time.sleep(1.0)
        ids = _ids(consts, seed=41)
        want = reference_rows(table["table"], table["scale"], ids)
        np.testing.assert_array_equal(np.asarray(store.rows_device(ids)).view(np.uint16), want.view(np.uint16))


def test_ring_python_wait_polls_slowly_when_idle():
    """Without the compiled poller the host thread's wait reads the header word in Python: as soon as it changes
    the new seq comes back; otherwise `last` after ~100 ms, having yielded between reads when busy and slept 500 us
    between them when idle (a few hundred reads at most, not a spin)."""
    class Header:                       # the header word, counting its reads
        def __init__(self, v):
            self.v, self.reads = v, 0

        def __getitem__(self, i):
            self.reads += 1
            return self.v

    for busy in (True, False):
        h = Header(3)
        assert RingStore._wait_header(types.SimpleNamespace(_poll=None, _header=h), 2, busy) == 3
        assert h.reads == 1
    reads = {}
    for busy in (True, False):
        h = Header(2)
        t0 = time.perf_counter()
        assert RingStore._wait_header(types.SimpleNamespace(_poll=None, _header=h), 2, busy) == 2
        assert 0.09 < time.perf_counter() - t0 < 1.0
        reads[busy] = h.reads
    assert reads[False] <= 250 < reads[True], reads
