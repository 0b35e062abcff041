"""Benchmark cases for QSA sparse decode attention: B = 1, T = 1 (decode) and T = 5 (MTP k=4 verify), contexts of
32K and 128K tokens, 512 selected blocks of 4 tokens plus a 3-token tail per query (2051 slots).

Impls: "pallas" (the kernel), "reference" (fnx.pallas.qsa.reference: XLA gather + einsum) and "dense_masked"
(what fnx.model.qsa.qsa_layer does without a kernel: masked attention over the whole cache).
`FNX_QSA_SWEEP="programs=1056;block_n=16,programs=1056;..."`: the kernel again per variant of its tile choice
(`fnx.pallas.qsa.pallas.Choice` fields over the default), impl "pallas[spec]", after the default's case.
Bytes floor = the K and V rows of the distinct selected tokens (per KV head) + q + out (+ the index list). Each
query row draws its own blocks here, so at T = 5 the floor is ~5x the T = 1 floor; real verify rows share most
blocks, which only helps the kernel (L2 reuse).

Also "qsa_index_scores" (the indexer scoring before top-k): bytes floor = the pooled block keys (NB x 128 x 2 B)
+ q + the fp32 scores written (L x NB x 4 B); FLOPs = 2 x L x 4 x 128 x NB.

And "qsa_prep" (the norms, RoPE and state writes between the projections and the block choice): "pallas" (one
launch, fnx.pallas.qsa.prep) against "reference" (the model's jnp, fnx.model.qsa.prep: a dozen XLA kernels). Its
bytes (the projections read, q, q_idx, the new K/V rows, blocks and ring written: ~60 KB a token) take ~0.02 us
at 4.3 TB/s, so the launches are its cost. A 256-token cache: neither path's time depends on the capacity, and the
benchmark's program does not donate its arguments, so each application copies the state it updates first (in
the model the state is donated)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from fnx.pallas import dispatch
from fnx.pallas.bench import BenchCase, n_sets
from fnx.pallas.qsa import api
from fnx.pallas.qsa import pallas as kernel

HQ, HKV, HD, CR, TOPK = 24, 2, 256, 4, 512
HI, DI = 4, 128


SWEEP_ENV = "FNX_QSA_SWEEP"


def sweep_choices() -> list[tuple[str, "kernel.Choice"]]:
    """`FNX_QSA_SWEEP`'s variants of the attention kernel's tile choice: (spec, Choice) each."""
    specs = [p.strip() for p in os.environ.get(SWEEP_ENV, "").split(";") if p.strip()]
    return [(s, kernel.parse_choice(s, SWEEP_ENV)) for s in specs]


def _indices(rng, bsz, length, ctx, topk, cr):
    """[B, L, topk * cr + cr - 1]: random complete blocks before the query plus a full 3-token tail."""
    n_blocks = (ctx - cr) // cr
    idx = np.empty((bsz, length, topk * cr + cr - 1), np.int32)
    for b in range(bsz):
        for l in range(length):
            blocks = rng.choice(n_blocks, size=topk, replace=False)
            idx[b, l, : topk * cr] = (blocks[:, None] * cr + np.arange(cr)).reshape(-1)
            idx[b, l, topk * cr:] = n_blocks * cr + np.arange(cr - 1)
    return idx


def _dense_masked(q, kc, vc, mask):
    """The model's reference path (fnx.model.qsa.qsa_layer) for the same token set."""
    dt = q.dtype
    bsz, length, hq, hd = q.shape
    hkv = kc.shape[1]
    qh = q.reshape(bsz, length, hkv, hq // hkv, hd)
    s = jnp.einsum("blgrd,bgtd->bgrlt", qh, kc, preferred_element_type=jnp.float32).astype(dt)
    s = (s.astype(jnp.float32) * hd ** -0.5).astype(dt).astype(jnp.float32)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    probs = jax.nn.softmax(s, axis=-1).astype(dt)
    o = jnp.einsum("bgrlt,bgtd->blgrd", probs, vc, preferred_element_type=jnp.float32).astype(dt)
    return o.reshape(bsz, length, hq, hd)


def cases(quick: bool) -> list[BenchCase]:
    out = []
    contexts = (4096,) if quick else (32768, 131072)
    topk = 64 if quick else TOPK
    rng = np.random.default_rng(0)
    # B = 1 is what a single stream decodes (latency: ~4 MB read at 32K); B = 8 puts enough bytes in one launch to
    # read the kernel's bandwidth against issue 8's 80%-of-4.3-TB/s target
    for ctx, length, bsz in ((c, t, b) for c in contexts for t in (1, 5) for b in ((1,) if quick else (1, 8))):
        idx0 = _indices(rng, bsz, length, ctx, topk, CR)
        uniq = sum(len(np.unique(idx0[b])) for b in range(bsz))
        n_sel = idx0.shape[-1]
        nbytes = (uniq * HKV * HD * 2 * 2            # K and V rows of the distinct selected tokens, bf16
                  + 2 * bsz * length * HQ * HD * 2     # q and out
                  + idx0.size * 4)
        flops = 4 * bsz * length * HQ * HD * n_sel
        sets = 2 if quick else n_sets(nbytes)
        key = jax.random.PRNGKey(ctx + length)
        arg_sets, dense_sets = [], []
        for i in range(sets):
            k1, k2, k3, key = jax.random.split(key, 4)
            q = jax.random.normal(k1, (bsz, length, HQ, HD), jnp.bfloat16)
            kc = jax.random.normal(k2, (bsz, HKV, ctx, HD), jnp.bfloat16)
            vc = jax.random.normal(k3, (bsz, HKV, ctx, HD), jnp.bfloat16)
            ix = idx0 if i == 0 else _indices(rng, bsz, length, ctx, topk, CR)
            mask = np.zeros((bsz, length, ctx), bool)
            for b in range(bsz):
                for l in range(length):
                    mask[b, l, ix[b, l]] = True
            arg_sets.append((q, kc, vc, jnp.asarray(ix)))
            dense_sets.append((q, kc, vc, jnp.asarray(mask)))
        shape = f"B={bsz} T={length} ctx={ctx} n_sel={n_sel}"
        extra = {"ctx": ctx, "T": length, "n_sel": n_sel, "distinct_tokens": int(uniq)}
        for impl in ("pallas", "reference"):
            out.append(BenchCase(
                kernel="qsa_decode_attention", shape=shape, impl=impl,
                fn=lambda q, k, v, i, _impl=impl: api.qsa_decode_attention(q, k, v, i, impl=_impl),
                arg_sets=arg_sets, bytes=nbytes, flops=flops, extra=dict(extra)))
            if impl == "pallas":
                for spec, choice in sweep_choices():
                    t = kernel.choose_tiles(bsz * length, HKV, n_sel, choice)
                    out.append(BenchCase(
                        kernel="qsa_decode_attention", shape=shape, impl=f"pallas[{spec}]",
                        fn=lambda q, k, v, i, _t=t: api.qsa_decode_attention(q, k, v, i, impl="pallas", tiles=_t),
                        arg_sets=arg_sets, bytes=nbytes, flops=flops, extra=dict(extra, tiles=str(t))))
        out.append(BenchCase(
            kernel="qsa_decode_attention", shape=shape, impl="dense_masked", fn=_dense_masked,
            arg_sets=dense_sets, bytes=nbytes, flops=flops,
            extra=dict(extra, note="model reference path: reads the whole cache")))
    out += score_cases(quick) + topk_cases(quick) + prep_cases(quick) + prefill_cases(quick)
    return out


def prefill_cases(quick: bool) -> list[BenchCase]:
    """"qsa_prefill_attention": one prefill chunk's masked attention (L = 2,048 queries, 24 heads over 2 KV heads
    of 256) at the end of an 8K context and at the start of a 32K one, the kernel ("pallas") against the model's
    key-chunked masked path ("chunked"). Masks: causal, each query's 512 blocks of 4 drawn from the blocks before
    it, plus its tail. FLOPs: the products over the keys a query may see (4 x hd per query, head and visible key
    position, causal); bytes: K and V up to the chunk's last position, q, o and the mask."""
    from fnx.model import qsa as model_qsa
    from fnx.pallas.qsa import prefill
    out = []
    length = 64 if quick else 2048
    for ctx, pos0 in (((256, 128),) if quick else ((8192, 6144), (32768, 0))):
        rng = np.random.default_rng(ctx + pos0)
        positions = pos0 + np.arange(length)
        tok = np.arange(ctx)
        causal = tok[None, :] <= positions[:, None]
        mask = np.zeros((length, ctx), bool)
        for i, pos in enumerate(positions):
            done = (pos + 1) // CR
            pick = rng.choice(done, min(TOPK, done), replace=False) if done else np.zeros(0, int)
            rows = (pick[:, None] * CR + np.arange(CR)[None, :]).reshape(-1)
            mask[i, rows] = True
            mask[i, done * CR:pos + 1] = True
        mask &= causal
        visible = int(causal.sum())
        flops = 4 * HQ * HD * visible
        seen = min(int(positions[-1]) + 1, ctx)
        nbytes = 2 * HKV * seen * HD * 2 + 2 * length * HQ * HD * 2 + length * ctx
        key = jax.random.PRNGKey(ctx)
        sets = []
        for _ in range(2 if quick else n_sets(nbytes)):
            k1, k2, k3, key = jax.random.split(key, 4)
            sets.append((jax.random.normal(k1, (1, length, HKV, HQ // HKV, HD), jnp.bfloat16),
                         jax.random.normal(k2, (1, HKV, ctx, HD), jnp.bfloat16),
                         jax.random.normal(k3, (1, HKV, ctx, HD), jnp.bfloat16),
                         jnp.asarray(mask[None]), jnp.asarray(positions[None], jnp.int32)))
        chunk = min(model_qsa.KEY_CHUNK, ctx // 2)
        ref = lambda q, k, v, m, p, _c=chunk: model_qsa._masked_attention_chunked(q, k, v, m, p, _c,  # noqa: E731
                                                                                 q.dtype)
        interp = dispatch.why_unavailable("pallas") is not None
        shape = f"L={length} ctx={ctx} pos0={pos0}"
        extra = {"ctx": ctx, "pos0": pos0, "L": length, "visible_keys": visible}
        out.append(BenchCase(kernel="qsa_prefill_attention", shape=shape, impl="pallas",
                             fn=lambda *a: prefill.qsa_prefill_attention(*a, interpret=interp), arg_sets=sets,
                             bytes=nbytes, flops=flops, extra=dict(extra), check=ref, check_tol=0.03))
        out.append(BenchCase(kernel="qsa_prefill_attention", shape=shape, impl="chunked", fn=ref, arg_sets=sets,
                             bytes=nbytes, flops=flops, extra=dict(extra, chunk=chunk)))
    return out


def topk_cases(quick: bool) -> list[BenchCase]:
    """The indexer's top-k block choice over a row of NB = ctx / 4 scores per query token: the kernel (one launch up
    to TOPK_MAX_BLOCKS, 64K context; two past it, op "qsa_block_topk_long") against lax.top_k's sort."""
    out = []
    for ctx in ((4096,) if quick else (8192, 65536, 131072, 262144)):
        nb = ctx // CR
        for length in (1, 5):
            nbytes = length * nb * 4 + length * TOPK * 4
            key = jax.random.PRNGKey(11 * ctx + length)
            arg_sets = [(jax.random.normal(jax.random.fold_in(key, i), (1, length, nb), jnp.float32),)
                        for i in range(2 if quick else 8)]
            for impl in ("pallas", "reference"):
                out.append(BenchCase(
                    kernel="qsa_block_topk", shape=f"B=1 T={length} ctx={ctx} blocks={nb}", impl=impl,
                    fn=lambda s, _impl=impl: api.qsa_block_topk(s, min(TOPK, nb), impl=_impl),
                    arg_sets=arg_sets, bytes=nbytes, flops=0, extra={"ctx": ctx, "T": length}))
    return out


def score_cases(quick: bool) -> list[BenchCase]:
    out = []
    for ctx in ((4096,) if quick else (32768, 131072)):
        nb = ctx // CR
        for length in (1, 5):
            nbytes = nb * DI * 2 + length * HI * DI * 2 + length * nb * 4
            sets = 2 if quick else n_sets(nbytes)
            key = jax.random.PRNGKey(7 * ctx + length)
            arg_sets = []
            for _ in range(sets):
                k1, k2, key = jax.random.split(key, 3)
                arg_sets.append((jax.random.normal(k1, (1, length, HI, DI), jnp.bfloat16),
                                 jax.random.normal(k2, (1, nb, DI), jnp.bfloat16),
                                 jnp.full((1, length), ctx - length, jnp.int32) + jnp.arange(length, dtype=jnp.int32)))
            for impl in ("pallas", "reference"):
                out.append(BenchCase(
                    kernel="qsa_index_scores", shape=f"B=1 T={length} ctx={ctx} blocks={nb}", impl=impl,
                    fn=lambda q, b, p, _impl=impl: api.qsa_index_scores(q, b, p, CR, impl=_impl),
                    arg_sets=arg_sets, bytes=nbytes, flops=2 * length * HI * DI * nb, extra={"ctx": ctx, "T": length}))
    return out


PREP_SIZES = (HI * DI + DI, 2 * HQ * HD, HKV * HD, HKV * HD)   # the fused product's windows: indexer, q, k, v


def prep_call(prod, norms, st, pos0, impl: str):
    """A QSA layer's prep at the released widths (`ModelConfig()`) for `prod` [1, L, sum(PREP_SIZES)], the four
    projections side by side: the model's jnp (impl "reference") or op qsa_prep's kernel reading them in place.
    norms: (indexer q, indexer k, q, k) layer norms; st the QSA state; pos0 [1]. (scripts/sass_count.py --qsa
    traces it too.)"""
    from fnx.config import ModelConfig
    from fnx.model import qsa
    from fnx.model.transformer import make_meta
    cfg, bf, length = ModelConfig(), prod.dtype, prod.shape[1]
    starts = [int(s) for s in np.cumsum((0,) + PREP_SIZES[:-1])]
    meta = make_meta(cfg, pos0, length, bf)
    p = {"indexer": {"q_layernorm": norms[0], "k_layernorm": norms[1]}, "q_norm": norms[2], "k_norm": norms[3]}
    if impl == "reference":
        prods = [prod[..., s:s + n] for s, n in zip(starts, PREP_SIZES)]
        return qsa.prep(p, prods, st, pos0, meta["cos"], meta["sin"], meta["rope_fn"], cfg, meta["n_valid"])
    bcos, bsin = qsa.block_rope_tables(pos0, length, cfg, bf)
    return api.qsa_prep(*[(prod, s) for s in starts], norms, meta["cos"], meta["sin"], bcos, bsin, pos0,
                        meta["n_valid"], st, cfg, impl)


def prep_cases(quick: bool) -> list[BenchCase]:
    from fnx.pallas.qsa import prep
    cap, bf = 256, jnp.bfloat16
    sizes = PREP_SIZES
    out = []
    for length in (1, 5):
        nbuf = prep.nbuf_rows(length, CR)
        nbytes = 2 * length * (sum(sizes) + HQ * HD + HI * DI + 2 * HKV * HD) + 2 * (nbuf + 2 * CR) * DI \
            + 2 * (nbuf // CR) * DI
        key = jax.random.PRNGKey(11 + length)
        arg_sets = []
        for i in range(2 if quick else 8):
            ks = jax.random.split(jax.random.fold_in(key, i), 6)
            prod = jax.random.normal(ks[0], (1, length, sum(sizes)), bf)
            st = {"k": jax.random.normal(ks[1], (1, HKV, cap, HD), bf),
                  "v": jax.random.normal(ks[2], (1, HKV, cap, HD), bf),
                  "idx_blocks": jax.random.normal(ks[3], (1, cap // CR, DI), bf),
                  "idx_ring": jax.random.normal(ks[4], (1, CR, DI), bf)}
            norms = tuple(0.1 * jax.random.normal(k, (n,), bf) for k, n in zip(jax.random.split(ks[5], 4),
                                                                                (DI, DI, HD, HD)))
            arg_sets.append((prod, norms, st, jnp.asarray([cap // 2 + 3 * i + 1], jnp.int32)))
        for impl in ("pallas", "reference"):
            out.append(BenchCase(
                kernel="qsa_prep", shape=f"B=1 T={length} cap={cap}", impl=impl,
                fn=lambda *a, _impl=impl: prep_call(*a, _impl), arg_sets=arg_sets, bytes=nbytes,
                extra={"T": length, "note": "launch-bound: the bytes are ~60 KB a token"}))
    return out
