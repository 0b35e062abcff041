"""The PLE ring's kernels (fnx/pallas/ple_ring): what `post` stores and what `wait` reads, in interpret mode and
the jnp reference, over a stand-in control block; the CUDA lowering; and on a GPU the kernels against a host
thread through a real pinned_host block (fnx.ple.ring, tests/ple/test_ring.py has the host side on the CPU)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from fnx.pallas.ple_ring import api, layout, pallas as ring_pallas


def _block(rng, max_ids, row_bytes, done, abandoned, base_words=7):
    """A stand-in memory: foreign words, then a control block at byte 4 * base_words with DONE / ABANDONED set and
    random bytes everywhere else (the ring's rows among them). -> (mem uint32, lo [1] uint32)."""
    total = layout.total_bytes(max_ids, row_bytes) // 4
    mem = rng.integers(0, 2**32, base_words + total, dtype=np.uint32)
    mem[base_words + layout.DONE // 4] = np.uint32(done % 2**32)
    mem[base_words + layout.ABANDONED // 4] = np.uint32(abandoned % 2**32)
    return mem, np.asarray([4 * base_words], np.uint32)


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
@pytest.mark.parametrize("n,done,abandoned", [(80, 5, 3), (5, 9, 12), (300, 2**31 - 1, 0), (1, 0, 0)])
def test_post_takes_the_next_seq_and_pairs_each_id(impl, n, done, abandoned):
    """seq = the later of DONE and ABANDONED, plus one (wrapping past 2^31 like the host's uint32 counter); one
    (seq, id) pair per row id in order, N not a multiple of a program's 128."""
    rng = np.random.default_rng(n)
    mem, lo = _block(rng, 512, 160, done, abandoned)
    ids = rng.integers(0, 2**31 - 1, n).astype(np.int32)
    seq, pairs = api.post(jnp.asarray(ids), jnp.asarray(lo), jnp.zeros_like(jnp.asarray(lo)), mem=jnp.asarray(mem),
                          impl=impl)
    want = np.int32(np.uint32((max(done, abandoned) if abs(done - abandoned) < 2**31 else done) + 1)
                    .astype(np.uint32).view(np.int32))
    seq, pairs = np.asarray(seq), np.asarray(pairs)
    assert (seq[:n] == want).all()
    np.testing.assert_array_equal(pairs[:n, 0], np.full(n, want))
    np.testing.assert_array_equal(pairs[:n, 1], ids)


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
@pytest.mark.parametrize("n,row_bytes,served", [(80, 160, True), (37, 20, True), (16, 160, False), (3, 8, False)])
def test_wait_reads_the_ring_rows_once_served(impl, n, row_bytes, served):
    """DONE equal to the ticket: the ring's first N rows, exactly (N not a multiple of 16, rows whose word count
    is not a power of two); DONE still behind: zero rows and ok 0 (the deadline path)."""
    rng = np.random.default_rng(n + row_bytes)
    max_ids = 96
    seq = 41
    mem, lo = _block(rng, max_ids, row_bytes, seq if served else seq - 1, 0)
    words = row_bytes // 4
    start = (int(lo[0]) + layout.rows_offset(max_ids)) // 4
    want = mem[start:start + n * words].reshape(n, words)
    ticket = jnp.full((128,), seq, jnp.int32)
    got, ok = api.wait(ticket, jnp.asarray(lo), jnp.zeros_like(jnp.asarray(lo)), jnp.asarray([1000], jnp.int32),
                       jnp.zeros((2, 3), jnp.bfloat16), n, row_bytes, max_ids, mem=jnp.asarray(mem), impl=impl)
    got, ok = np.asarray(got), np.asarray(ok)
    assert got.shape == (n, words) and got.dtype == np.uint32
    if served:
        np.testing.assert_array_equal(got, want)
        assert (ok[:n] == 1).all()
    else:
        assert not got.any() and (ok[:n] == 0).all()


def test_ring_refuses_what_it_cannot_do():
    lo = jnp.zeros((1,), jnp.uint32)
    mem = jnp.zeros((layout.total_bytes(16, 8) // 4,), jnp.uint32)
    t, tmo, dep = jnp.zeros((128,), jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1,))
    with pytest.raises(ValueError, match="multiple of 4"):
        api.wait(t, lo, lo, tmo, dep, 4, 6, 16, mem=mem, impl="pallas_interpret")
    with pytest.raises(ValueError, match="exceeds the ring's 16"):
        api.wait(t, lo, lo, tmo, dep, 17, 8, 16, mem=mem)
    with pytest.raises(ValueError, match="real host addresses need the compiled kernel"):
        api.post(jnp.zeros((4,), jnp.int32), lo, lo, impl="reference")
    with pytest.raises(ValueError, match="stand-in memory runs"):
        api.post(jnp.zeros((4,), jnp.int32), lo, lo, mem=mem, impl="pallas")
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="cannot run here"):
            api.post(jnp.zeros((4,), jnp.int32), lo, lo)


def test_ring_lowers_for_cuda():
    """Both kernels (system-scope PTX stores and loads, the spin on DONE with its %globaltimer deadline) lower
    through Pallas -> Triton for CUDA at a five-token decode request (80 FP8 rows of 160 bytes) and a prefill
    chunk's (32,768 rows), after a producer they must follow."""
    S = jax.ShapeDtypeStruct

    def f(ids, lo, hi, tmo, h):
        t = ring_pallas.post(ids, lo, hi)
        w, ok = ring_pallas.wait(t, lo, hi, tmo, h, ids.shape[0], 160, 32768)
        return w, ok

    for n in (80, 32768):
        text = jax.jit(f).trace(S((n,), jnp.int32), S((1,), jnp.uint32), S((1,), jnp.uint32), S((1,), jnp.int32),
                                S((1, 5, 64), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 2
