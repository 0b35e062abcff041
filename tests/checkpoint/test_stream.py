"""Streaming load: the n-gram table as a host view over its shards, device assembly, the progress bar."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fnx.checkpoint import NgramTableView, load_checkpoint

TABLE = ("ple", "ple_embedding", "ngram_embedding")


def _table(params, layer=1):
    p = params["segments"][layer][0]
    for k in TABLE:
        p = p[k]
    return np.asarray(p)


def test_host_view_rows_match_device_table(src):
    dev = load_checkpoint(src, dtype=np.float32)
    host = load_checkpoint(src, dtype=np.float32, ngram_table="host")
    assert "ple_embedding" not in host.params["segments"][1][0]["ple"]
    view = host.ngram[1]
    assert isinstance(view, NgramTableView) and view.shape == (416, 8) and len(view.shards) == 4
    for s in view.shards:          # views into the mapped files, not copies
        assert not s.flags.owndata and not s.flags.writeable
    ids = np.random.default_rng(0).integers(0, 416, (3, 5, 4))
    table = _table(dev.params)
    np.testing.assert_array_equal(view.rows(ids), table[ids])
    np.testing.assert_array_equal(view.lookup(ids, np.float32), table[ids])


def test_fp8_table_view_and_device_assembly_agree(fp8_dirs):
    fp8, deq = fp8_dirs
    dev = load_checkpoint(fp8, dtype=np.float32)
    host = load_checkpoint(fp8, dtype=np.float32, ngram_table="host")
    view = host.ngram[1]
    assert view.dtype == ml_dtypes.float8_e4m3fn and view.scale.dtype == ml_dtypes.bfloat16
    ids = np.arange(416)
    np.testing.assert_array_equal(view.lookup(ids, np.float32), _table(dev.params))
    # and both equal the reference dequantization bf16(row) * scale written by the test writer
    np.testing.assert_array_equal(_table(dev.params), _table(load_checkpoint(deq, dtype=np.float32).params))


def test_progress_bar_reports_bytes(src, capsys):
    out = load_checkpoint(src, dtype=jnp.bfloat16, progress=True)
    err = capsys.readouterr().err
    assert "loading" in err and "B/s" in err
    assert out.stats["bytes"] > 0 and out.params["lm_head"].dtype == jnp.bfloat16


def test_fused_and_per_expert_layouts_load_the_same(src, tmp_path):
    """save_pretrained writes experts one by one; the BF16 release stores them fused. Both give the same tree."""
    import jax
    from tests.checkpoint.gguf_writer import _fuse_experts
    from tests.checkpoint.writers import _write_dir, read_all
    sd = read_all(src)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in sd)
    fused = _write_dir(src, tmp_path / "fused", _fuse_experts(sd), None)
    a, b = load_checkpoint(src, dtype=np.float32), load_checkpoint(fused, dtype=np.float32)
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
