"""The UVA row gather (fnx/pallas/uva_gather): chunk lookup and byte addressing against NumPy on a stand-in
memory (interpret mode and the jnp reference), the CUDA lowering, and on a GPU the real thing: rows read by the
kernel from a pinned_host buffer through its host address, equal to the bytes put there."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from fnx.pallas.uva_gather import api, pallas as uva_pallas


def _layout(rng, chunk_rows, row_bytes, gap_words=3):
    """A stand-in memory of several chunks (each at its own byte offset, with gaps between them) and the table
    rows it holds, stacked: (mem uint32, starts, lo, table [rows, row_bytes] uint8)."""
    rows = sum(chunk_rows)
    table = rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    words, starts, lo, pos, r0 = [], [], [], 0, 0
    for n in chunk_rows:
        words.append(rng.integers(0, 2**32, gap_words, dtype=np.uint32))   # bytes no row owns
        pos += 4 * gap_words
        starts.append(r0)
        lo.append(pos)
        words.append(table[r0:r0 + n].reshape(-1).view(np.uint32))
        pos += n * row_bytes
        r0 += n
    return (np.concatenate(words), np.asarray(starts, np.int32), np.asarray(lo, np.uint32), table)


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
@pytest.mark.parametrize("chunk_rows,row_bytes,n", [((5, 7, 3), 160, 37), ((64,), 8, 16), ((2, 1, 9, 4), 20, 5)])
def test_gather_reads_each_row_from_its_chunk(impl, chunk_rows, row_bytes, n):
    """Rows in unequal chunks at arbitrary byte offsets (gaps of foreign bytes between them), ids that hit every
    chunk's first and last rows and repeat; N not a multiple of the program's 16 requests; rows whose word count is
    not a power of two (the padded lanes are sliced off): every row's bytes exactly."""
    rng = np.random.default_rng(n)
    mem, starts, lo, table = _layout(rng, chunk_rows, row_bytes)
    edges = np.concatenate([starts, np.asarray(starts[1:].tolist() + [table.shape[0]]) - 1])
    ids = np.concatenate([edges, rng.integers(0, table.shape[0], n)]).astype(np.int32)
    got = api.gather_words(jnp.asarray(ids), jnp.asarray(starts), jnp.asarray(lo), jnp.zeros_like(jnp.asarray(lo)),
                           row_bytes, mem=jnp.asarray(mem), impl=impl)
    got = np.asarray(got)
    assert got.shape == (len(ids), row_bytes // 4) and got.dtype == np.uint32
    np.testing.assert_array_equal(got.view(np.uint8).reshape(len(ids), row_bytes), table[ids])


def test_gather_refuses_what_it_cannot_do():
    ids, starts, lo = jnp.zeros((4,), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.uint32)
    mem = jnp.zeros((16,), jnp.uint32)
    with pytest.raises(ValueError, match="multiple of 4"):
        api.gather_words(ids, starts, lo, lo, 6, mem=mem, impl="pallas_interpret")
    with pytest.raises(ValueError, match="real host addresses need the compiled kernel"):
        api.gather_words(ids, starts, lo, lo, 8, impl="reference")
    with pytest.raises(ValueError, match="stand-in memory runs"):
        api.gather_words(ids, starts, lo, lo, 8, mem=mem, impl="pallas")
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="cannot run here"):
            api.gather_words(ids, starts, lo, lo, 8)


def test_gather_lowers_for_cuda():
    """The real-address kernel (inline PTX load from a 64-bit address built from two 32-bit halves) lowers through
    Pallas -> Triton for CUDA at a decode step's size (5 tokens x 16 heads of 160-byte FP8 rows) over 49 chunks."""
    S = jax.ShapeDtypeStruct
    lowered = jax.jit(lambda i, s, lo, hi: uva_pallas.gather_words(i, s, lo, hi, 160)).trace(
        S((80,), jnp.int32), S((49,), jnp.int32), S((49,), jnp.uint32), S((49,), jnp.uint32)).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
def test_gather_reads_pinned_host_memory():
    """On a GPU: rows put into pinned_host buffers (several chunks), read by the kernel from their host addresses
    under unified virtual addressing, equal to the bytes put there."""
    from jax.sharding import SingleDeviceSharding
    dev = jax.devices()[0]
    if "pinned_host" not in [m.kind for m in dev.addressable_memories()]:
        pytest.skip("no pinned_host memory on this device")
    rng = np.random.default_rng(0)
    row_bytes, chunk_rows = 160, (1000, 700, 1300)
    table = rng.integers(0, 256, (sum(chunk_rows), row_bytes), dtype=np.uint8)
    bufs, starts, addrs, r0 = [], [], [], 0
    for n in chunk_rows:
        b = jax.device_put(table[r0:r0 + n], SingleDeviceSharding(dev, memory_kind="pinned_host"))
        b.block_until_ready()
        bufs.append(b)
        addrs.append(b.unsafe_buffer_pointer())
        starts.append(r0)
        r0 += n
    addrs = np.asarray(addrs, np.uint64)
    lo, hi = (addrs & np.uint64(0xFFFFFFFF)).astype(np.uint32), (addrs >> np.uint64(32)).astype(np.uint32)
    ids = rng.integers(0, table.shape[0], 80).astype(np.int32)
    got = jax.jit(lambda i, s, a, b: api.gather_words(i, s, a, b, row_bytes))(ids, np.asarray(starts, np.int32), lo, hi)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8).reshape(len(ids), row_bytes), table[ids])
    del bufs
