"""Explicit backend choice for every kernel (never silent).

Backends, by name:
  "reference"         plain jnp (the ground truth; runs everywhere, and the XLA path on V100 and CPU).
  "pallas"            Pallas with the Triton lowering, compiled by XLA's bundled Triton; needs a CUDA GPU of
                      compute capability >= 8.0 (Ampere through sm_120).
  "pallas_interpret"  the same Pallas kernel body run by the Pallas interpreter (CPU tests; slow).

`resolve(op, impl)`:
  impl None or "auto": the env var FNX_KERNELS when it names a backend for this op, otherwise "pallas" where it
  can run, the op is in VERIFIED_ON_GPU and not in AUTO_KEEPS_REFERENCE (kernels that lost to XLA in a
  whole-model measurement), and the caller gives no `prefer_reference` reason for this call's shape or format,
  then "reference". FNX_KERNELS is either one backend for every op ("reference" forces every op onto
  its reference) or a comma list "op=backend,..." ("gemv_fp8=reference,gdn_decode=pallas"); a backend named
  there that cannot run is an error, not a fallback. It is read when a function is traced, so set it before
  the first jitted call (or clear JAX's caches). Which backend ran is logged once per op.
  impl a backend name: that backend, or a ValueError saying why it cannot run here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import contextvars
import logging
import os

import jax

log = logging.getLogger("fnx.pallas")

BACKENDS = ("reference", "pallas", "pallas_interpret")

# Every op name `resolve` is called with (tests/pallas/test_dispatch.py checks each kernel module's names against
# it). FNX_KERNELS="op=backend" with any other op name is an error: a misspelt name would otherwise leave every op
# on "auto" without a word.
KNOWN_OPS = ("gemv_bf16", "gemv_fp8", "gemv_nvfp4", "gemv_bf16_argmax", "gemv_fp8_argmax", "gemv_nvfp4_argmax",
             "gemv_pair", "gemv_pair_many", "gdn_decode", "gdn_step", "gdn_window", "gdn_window_parts",
             "gdn_prefill", "gdn_chunk_prep", "gdn_replay_conv",
             "hc_boundary", "hc_boundary_m1", "hc_boundary_few", "hc_boundary_one",
             "hc_boundary_few_one", "hc_boundary_prefill", "hc_mix_prefill", "hc_norm_prefill",
             "qsa_decode_attention", "qsa_index_scores", "qsa_block_topk", "qsa_block_topk_long", "qsa_combine",
             "qsa_prep", "qsa_prefill_attention", "qsa_select", "qsa_select_long",
             "moe_route", "moe_route_acts", "moe_experts",
             "moe_decode", "moe_grouped", "dequant_fp8", "gdn_out_norm", "moe_route_prefill")

# Ops whose compiled kernel has passed its tests on a GPU (`pytest tests/pallas` on the H200 runs every kernel
# test against the compiled kernel): only these are picked by "auto". Every other kernel is tested in interpret
# mode and lowers for CUDA, but runs on a GPU only when named (impl= or FNX_KERNELS), until its GPU run passes.
VERIFIED_ON_GPU = {
    "gemv_bf16": "H200, 2026-11-30, tests/pallas/test_gemv.py -m gpu",
    "gemv_fp8": "H200, 2026-11-30, tests/pallas/test_gemv.py -m gpu; the whole-K modes: 2026-12-01, commit "
                "20d02ac, tests/pallas/test_gemv.py whole-K cases",
    "gemv_bf16_argmax": "H200, 2026-11-30, tests/pallas/test_gemv.py -m gpu",
    "gemv_fp8_argmax": "H200, 2026-11-30, tests/pallas/test_gemv.py -m gpu",
    "gemv_nvfp4": "H200, 2026-11-30, commit f2cc69b: tests/pallas/test_gemv.py (all 29, released shapes included)",
    # measured on in the 48-layer FP8 + NVFP4 step (twelfth H200 session): 877 kernels and 5.52 ms of kernel time
    # per step against 973 / 5.67 ms with the two products apart (commit 20e27fc)
    "gemv_pair": "H200, 2026-12-01, commit 1e3722f: tests/pallas/test_gemv.py -k pair (all 7); with the tuned rows-2 "
                 "tiles: 2026-12-02, commit 93f8284, -k pair_equals (all 5)",
    "gdn_decode": "H200, 2026-11-30, commit f2cc69b: tests/pallas/test_gdn.py (all 14)",
    # with "tf32" products (the chunked path's default) a 4-layer 2,048-token chunk 14.79 ms against 16.93 with
    # "tf32x3" and XLA's prep (H100, 4a8ea81, the kernel at 8 warps; at 4, the default since, alone 284 us a layer
    # against 422); with other products "auto" keeps XLA's (api.chunk_prep_auto_reason)
    "gdn_chunk_prep": "H100, 2026-12-06, commit 4a8ea81: tests/pallas/test_gdn.py -k 'chunk_prep or chunked_prefill' "
                      "(all 7)",
    "gdn_step": "H200, 2026-12-01, commit d8545d0: tests/pallas/test_gdn.py (all 25; also 1f19306, all 23)",
    # the 4-layer MTP verify program at 8K (thirty-first H200 session): 173 kernels and 0.946 ms of kernel time
    # against 181 / 0.958 with the model's ops for the window (the conv, gates and norm as XLA fusions)
    "gdn_window": "H200, 2026-12-04, commit 54c3f01: tests/pallas/test_gdn.py -k 'window and not model' (all 8)",
    "hc_boundary": "H200, 2026-11-30, commit c7a432e: tests/pallas/test_hc.py (all 10)",
    "hc_boundary_few": "H200, 2026-12-03, commit 7b48f01: tests/pallas/test_hc.py -k mma_design (all 7), the MMA "
                       "design (few.py); the per-token kernels (Tiles1): commit 2b161d1 -k few_token_kernels_match "
                       "(all 4, 'loop'), both layouts ('grid' and 'loop', 8 cases) at commit 0400fd0",
    "gdn_prefill": "H200, 2026-12-02, commit 0400fd0: tests/pallas/test_gdn.py -k chunk (the chunk-scan kernel "
                   "against the reference, and the chunked prefill through it against token-by-token decoding)",
    # the one-launch boundaries (hc/one.py) run only where FNX_KERNELS names them (hc.api.one_launch_backend)
    "hc_boundary_one": "H200, 2026-12-05, commit afb092f: tests/pallas/test_hc_one.py -k one_launch (the one launch "
                       "against the two kernels, bit for bit; the model's decode step and verify window through it)",
    "hc_boundary_few_one": "H200, 2026-12-05, commit afb092f: tests/pallas/test_hc_one.py -k one_launch (2-8 tokens "
                           "against the reference); its second form H100, 2026-12-05, commit 313f834: -k 'few or "
                           "verify_window or lowers' (23 of 24: the split test ran under the interpreter on the GPU "
                           "and saw NaN; compiled, it passed at 38fabd8, -k 'few or refuses')",
    "hc_boundary_m1": "H200, 2026-11-30, commits 4761459, 4ccfef6 and 140df28: tests/pallas/test_hc.py (all 18)",
    "qsa_decode_attention": "H200, 2026-11-30, commit ef452e4: tests/pallas/test_qsa.py (all pass)",
    "qsa_index_scores": "H200, 2026-11-30, commit ef452e4: tests/pallas/test_qsa.py (all pass)",
    # on under auto: 4 layers, FP8, 8K context, H200, commit 1ddebd7: the MTP round 4.74 ms wall / 3.347 ms kernel
    # time against 5.14 / 3.399 with lax.top_k's sort; the 48-layer served step 4.612 ms of kernel time in 948
    # kernels against 4.778 in 960 (BENCHMARKS.md, twentieth H200 session)
    "qsa_block_topk": "H200, 2026-12-03, commit 1ddebd7: tests/pallas/test_qsa.py -k block_topk (all 5: the top-k "
                      "set at 70 / 2,122 / 40 / 33 blocks with ties and -inf rows, and the CUDA lowering)",
    # on under auto: the step's QSA layer at 8K merged its splits and gated in 4.6 us against ~6.1 us in four XLA
    # kernels (4-layer round table, H200, commit fb693e8)
    "qsa_combine": "H200, 2026-12-04, commit 0b8e35c: tests/pallas/test_qsa.py -k \"combine or gate or "
                   "kernel_matches or qsa_layer or lowers\" (all 15)",
    # on under auto, these three: the 4-layer round at 8K (step, draft and verify programs, FP8 + NVFP4, served
    # heads; H200, commit d9f4565, 2026-12-05; scripts/probe_launch.py --round-variants, BENCHMARKS.md thirty-sixth
    # session): kernel time per round against all three off, one variant each: qsa_prep -23.2 us (step -7.3),
    # gemv_pair_many -8.1, moe_route_acts -5.9; the three with the GEMV's xfirst -51.0 us, 1691 -> 1640 us
    "qsa_prep": "H200, 2026-12-05, commit d9f4565: tests/pallas/test_qsa_prep.py (all, the model's verify and "
                "rollback through the kernel included)",
    # on under "auto" for prefill-sized calls on a GPU; timed on an H100 (2026-12-06, dac0c0f): 2,346 against
    # 3,553 us for the key-chunked XLA path at 2,048 queries and 8K context, a 4-layer 2,048-token chunk 4.3% faster
    "qsa_prefill_attention": "H100, 2026-12-06, commit 75817ec: tests/pallas/test_qsa_prefill.py (all 13), run with "
                             "FNX_DOT_ACC=1 exported (its products accumulate in the MMA; the default adds them "
                             "apart, as every other verified kernel does)",
    "gemv_pair_many": "H200, 2026-12-05, commit d9f4565: tests/pallas/test_gemv.py -k 'pair_many or pair_product' (the "
                      "kernel against the two products, lowering; the wiring test's auto check was the test's own "
                      "error, mended) and tests/pallas/test_gdn.py -k pair_product",
    "moe_route_acts": "H200, 2026-12-05, commit d9f4565: tests/pallas/test_moe.py -k 'route_acts or route_writes'",
    "moe_route": "H200, 2026-11-30, commit ef452e4: tests/pallas/test_moe.py (all pass)",
    "moe_experts": "H200, 2026-11-30, commit ef452e4: tests/pallas/test_moe.py (all pass)",
    "moe_decode": "H200, 2026-12-01, commits bba8d84 (tests/pallas/test_moe.py, all 31) and 4a34368 (its 20 "
                  "decode cases at the measured tiles); the loads-first kernels at e055557 (all 21 decode tests); "
                  "group sums, hfma and unrounded weights at 93f8284 (all 15 of those tests)",
    "moe_grouped": "H200, 2026-12-01, commit e055557: tests/pallas/test_moe.py blocks and grouped cases (all 5)",
    # on under auto for prefill chunks: the 4-layer 2,048-token chunk at 8K (H100, e2b0c6b, 2026-12-07, one process
    # with the base): the kernel 111.1 us for the three GDN layers where XLA's transpose + norm fusion took 159.7
    # (-48.6 us); the 24-layer 8K prefill's kernel time 265.5 ms against 266.7 (its wall time level, 30,141 against
    # 30,269 tok/s). BENCHMARKS.md, fifty-third session
    "gdn_out_norm": "H100, 2026-12-07, commit e2b0c6b: tests/pallas/test_gdn_out_norm.py (all)",
    "dequant_fp8": "H100, 2026-12-07, commit e2b0c6b: tests/pallas/test_dequant.py (all)",
    # on under auto past the decode router's 64 rows: the 4-layer 2,048-token chunk at 8K (H100, 715b89e, 2026-12-07,
    # one process with the base) 11,921.8 -> 11,762.2 us (-159.5; two base runs 30 us apart), XLA's softmax + sort
    # fusions gone (4 launches fewer). BENCHMARKS.md, fifty-fourth session
    "moe_route_prefill": "H100, 2026-12-07, commit 715b89e: tests/pallas/test_moe.py -k 'prefill_route or "
                         "route_matches' (all)",
    # on under auto past TOPK_MAX_BLOCKS (128K and 256K context): 45.5 us against lax.top_k's 65.3 at 128K, 55.2
    # against 65.1 at 256K (H100, e2b0c6b, bench_kernels); rows up to 64K context keep the one-launch kernel
    "qsa_block_topk_long": "H100, 2026-12-07, commit 715b89e: tests/pallas/test_qsa.py -k block_topk (all, the long "
                           "rows' segments and dispatch, the early stop)",
    # qsa_select measured (H100, bde9def, the 4-layer round at 8K): kernel time -5.5 us a step and -25.3 a round, 3
    # launches fewer a step (11 a round), chained level (+1.0 / +5.6 us, inside the spread; BENCHMARKS.md
    # fifty-ninth session); FNX_KERNELS=qsa_select=reference gives the separate ops
    "qsa_select": "H100, 2026-12-07, commit bde9def: tests/pallas/test_qsa_select.py (all 9) and test_qsa.py's "
                  "selection tests through it (18 passed); with its token stores split per column and the top-k "
                  "searches at e9c0437 (32 passed, H100)",
    # qsa_select_long measured (H100, e9c0437, the 4-layer round at 128K context): 45.0 us a call where XLA's scores,
    # the two-launch top-k and two fusions took 71.4; kernel time -26.4 us a step, -95.2 a round, chained -34.2 /
    # -93.0 us (BENCHMARKS.md sixtieth session)
    "qsa_select_long": "H100, 2026-12-07, commit e9c0437: tests/pallas/test_qsa_select.py (all, the segments with "
                       "each top-k search) and test_qsa.py's selection tests (32 passed with test_gdn.py's counters)",
    # the HC prefill kernels run only where FNX_KERNELS names them (AUTO_KEEPS_REFERENCE below)
    "hc_boundary_prefill": "H100, 2026-12-06, commit cc01f54: tests/pallas/test_hc.py -k prefill (the two kernels "
                           "against the reference, the model's boundaries through them; 14 passed with the MoE "
                           "split_store cases)",
    "hc_norm_prefill": "H100, 2026-12-07, commit 224808c: tests/pallas/test_hc.py -k 'norm_prefill or norm_and_mix' "
                       "(all but the decode-size launch count, whose premise was wrong on a GPU: mended in ac922a0)",
    "hc_mix_prefill": "H100, 2026-12-07, commit ac922a0 (one row block a program): tests/pallas/test_hc.py -k "
                      "'mix_prefill or norm_and_mix' (all 12)",
}

# Verified ops that "auto" still leaves on the reference, with the measurement that says why (logged once);
# FNX_KERNELS=op=pallas still runs the kernel.
_MODEL_AB = ("the whole bf16 decode step on the H200 (4 layers, 1K context, 2026-11-30, commit e7dd728, "
             "`probe_launch.py --kernel-variants`; BENCHMARKS.md, fourth H200 session): device time per step "
             "with every kernel on the reference 0.904 ms, with the verified kernels 1.170 ms")
AUTO_KEEPS_REFERENCE = {
    "moe_route": "measured slower together with moe_experts, the older decode path: on the H200 the MoE decode "
                 "layer with the Pallas route + experts is slower than XLA (M=1 bf16 90 vs 73 us, FP8 96 vs 77, "
                 "NVFP4 146 vs 94; BENCHMARKS.md); in the whole step 1.303 vs 1.170 ms (" + _MODEL_AB + "). The "
                 "fused decode path (moe_decode) runs the routing kernel on its own backend: the two were measured "
                 "together",
    "moe_experts": "measured slower: see moe_route",
    "dequant_fp8": "measured slower: in the 4-layer 2,048-token prefill chunk at 8K its 35 launches took 410.5 us "
                   "where XLA's dequantizing fusions of the same weights took 424.5, and the chunk 12,136 us against "
                   "12,059 (H100, commit e2b0c6b, BENCHMARKS.md fifty-third session): XLA's fusions already stream "
                   "at the bandwidth. Only FNX_KERNELS names it",
    # qsa_decode_attention: "auto" keeps the masked dense path per call below a KV capacity of 8K
    # (fnx.pallas.qsa.api.auto_reason: slower at 1K in the whole step, faster at 8K in it, 2x at 32K in isolation)
    "qsa_index_scores": "measured slower: apart at 8K context (2,122 blocks) 283.6 us per call against 5.4 us for "
                        "XLA's product in the step (4-layer round table, H200, commit fb693e8); earlier together "
                        "with the attention kernel in the whole step at 1K context: 1.450 vs 1.170 ms (" + _MODEL_AB +
                        ")",
    # the one-token boundary (hc_boundary_m1) is on: 0.865 / 0.869 / 0.866 ms per chained step against 0.902 /
    # 0.906 with the reference (H200, 4 layers bf16, commit 140df28; BENCHMARKS.md "Sixth H200 session")
    "hc_boundary": "the multi-token boundary (2-32 tokens) measured slower in the whole step: with the HC kernel 1.170 ms, its XLA reference 1.020 ms ("
                   + _MODEL_AB + ")",
    # hc_boundary_few is on (the MMA design, few.py): the 4-layer verify program at 8K (FP8 + NVFP4, served heads,
    # H200, commit 7b48f01) took 1.049 ms in 188 kernels against 1.111 ms in 212 with XLA's boundary (95f10c8): about
    # 15 us per five-token boundary against 22.6. The per-token kernels (Tiles1) had measured slower than XLA's (33 and
    # 31 us per boundary, commits 2b161d1 / 0400fd0)
    # gdn_prefill is on: with "tf32x3" products the chunk pass took 0.42 / 3.07 ms for 1K / 8K tokens against 0.69 /
    # 5.01 ms for XLA's scan (H200, commit 89aa848; the "ieee" products of the first kernel took 6.73 / 53.1 ms)
    "hc_boundary_one": "measured slower: 12.2 us per one-token boundary in one launch against 8.6 for the two "
                       "kernels; the 4-layer step at 8K 571.2 us of kernel time in 76 kernels against 537.1 in 84 "
                       "(H200, commit afb092f, BENCHMARKS.md thirty-ninth session). Only FNX_KERNELS names it",
    "hc_boundary_few_one": "measured slower: 30.7 us per five-token boundary in one launch (second form, three "
                           "phases) where the launches it replaces take ~16 us; the 4-layer verify program at 8K "
                           "1,140 us of kernel time in 100 kernels against 1,003 in 144 (H100, commit 313f834, "
                           "BENCHMARKS.md forty-second session). Only FNX_KERNELS names it",
    "hc_boundary_prefill": "measured slower: the 4-layer 2,048-token chunk 18,150 us against XLA's 17,081 (the down "
                           "kernel ~130-160 us a boundary and the up kernel ~139, where XLA's whole boundary takes "
                           "~165; H100, commit 0ed5ef9, BENCHMARKS.md forty-eighth session). Only FNX_KERNELS names it",
    "hc_norm_prefill": "measured level: in the 4-layer 2,048-token chunk at 8K its 9 launches took 447.6 us where "
                       "XLA's combine and norm fusions took 500.8, but the chunk 11,721.3 us against 11,682.7 (two "
                       "base runs 10 us apart; H100, commit 224808c, BENCHMARKS.md fifty-fifth session). Only "
                       "FNX_KERNELS names it",
    "hc_mix_prefill": "measured level at best: 87-94 us a boundary of a 2,048-token chunk against XLA's gates product "
                      "and mix, ~85 (the 4-layer chunk at 8K 11,608 / 11,738 us with bm 128 / 64 against base runs "
                      "of 11,710 and 11,667; H100, commit ac922a0; the first design, column tiles walking the rows, "
                      "117 us, 224808c; BENCHMARKS.md fifty-fifth session). Only FNX_KERNELS names it",
    "gemv_bf16": "measured slower in the whole step: with the bf16 GEMV kernels 1.170 ms, XLA's dots 1.095 ms "
                 "(XLA fuses the norms and casts around them; " + _MODEL_AB + ")",
    "gemv_bf16_argmax": "see gemv_bf16",
    # gdn_decode: "auto" keeps the reference for one token only (fnx.pallas.gdn.api.ONE_TOKEN_REASON), where a
    # decode step runs gdn_step anyway; verify windows take the kernel
    # gemv_fp8 is on: in the FP8 step (4 layers, fused projections, FP8 lm_head; H200, commit b189f03) the
    # whole-K kernels took 0.746 ms of kernel time per step against 0.847 with XLA's dequantize-and-dot: the
    # lm_head 168 us against 272, the other FP8 projections 153 us against 149 (BENCHMARKS.md, seventh session)
    # gemv_fp8_argmax is on where its tiles take whole K in one program ("fma": the MTP draft head at one token);
    # with looped tiles "auto" keeps XLA's (fnx.pallas.gemv.api.ARGMAX_LOOP_REASON)
}
_logged: set[tuple[str, str]] = set()
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("fnx_kernels_forced", default=None)
_mesh: contextvars.ContextVar = contextvars.ContextVar("fnx_kernels_mesh", default=None)
_scanned: contextvars.ContextVar[bool] = contextvars.ContextVar("fnx_kernels_scanned", default=False)

# Ops whose kernels run per shard on a device mesh (`on_mesh`): each is wrapped in a custom partitioning rule
# that calls the kernel on every device's shard (and reduces across devices where the contraction is split).
# Every other op takes its reference inside `on_mesh`, which the SPMD partitioner splits.
MESH_READY = ("gemv_bf16", "gemv_fp8", "gemv_nvfp4")


@contextlib.contextmanager
def force(backend: str):
    """Trace everything inside with `backend` for every op whose impl is auto (e.g. "reference" for a program
    partitioned over a mesh, where a Pallas call outside shard_map would be gathered onto every device)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    tok = _forced.set(backend)
    try:
        yield
    finally:
        _forced.reset(tok)


@contextlib.contextmanager
def on_mesh(mesh):
    """Trace everything inside for params and state laid out on `mesh`: ops in MESH_READY run their kernel per
    shard (`active_mesh()` tells them the mesh); every other op whose impl is auto takes its reference (a Pallas
    call outside a per-shard wrapper would be gathered onto every device)."""
    tok = _mesh.set(mesh)
    try:
        yield
    finally:
        _mesh.reset(tok)


def active_mesh():
    """The mesh of the enclosing `on_mesh`, or None."""
    return _mesh.get()


@contextlib.contextmanager
def in_scanned_layers():
    """Trace everything inside as the body of a scan over stacked layer params (fnx.model.transformer): there a
    Pallas call's weight operand is a slice the loop copies out of its stack each step (a custom call takes whole
    buffers), so kernels that read a small part of a large weight (the MoE experts: 10 of 512) keep the reference
    under "auto" (`scanned_layers()`)."""
    tok = _scanned.set(True)
    try:
        yield
    finally:
        _scanned.reset(tok)


def scanned_layers() -> bool:
    """True inside `in_scanned_layers`."""
    return _scanned.get()


def gpu_compute_capability() -> int | None:
    """The first CUDA device's compute capability as an int (90 for sm_90), or None without a CUDA GPU."""
    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return None
    if not devs or devs[0].platform != "gpu":
        return None
    cc = getattr(devs[0], "compute_capability", None)
    if cc is None:
        return None
    try:
        return int(str(cc).replace(".", ""))
    except ValueError:  # ROCm reports gfx names
        return None


def why_unavailable(backend: str) -> str | None:
    """None when `backend` can run on this process's default device, else the reason it cannot."""
    if backend in ("reference", "pallas_interpret"):
        return None
    if backend == "pallas":
        if jax.default_backend() != "gpu":
            return f"the default JAX backend is {jax.default_backend()!r}, not a CUDA GPU"
        cc = gpu_compute_capability()
        if cc is None:
            return "no CUDA device with a compute capability was found"
        if cc < 80:
            return (f"Pallas' Triton lowering needs compute capability >= 8.0 and this GPU is {cc / 10:.1f}; "
                    "on V100 fnx runs the XLA reference path")
        return None
    return f"unknown backend {backend!r}; choose one of {BACKENDS}"


class NotApplicable(NotImplementedError, ValueError):
    """A kernel was named for a call it does not serve (a shape or format outside its implementation)."""


def resolve(op: str, impl: str | None = None, *, supported: tuple[str, ...] = BACKENDS,
            not_applicable: str | None = None, prefer_reference: str | None = None) -> str:
    """The backend `op` will run with. Raises ValueError for a named backend that cannot run here.

    not_applicable: why the kernel does not serve this particular call (None when it does). Auto, and a backend
    chosen by FNX_KERNELS, then take the reference for this call; an explicit impl raises NotApplicable.
    prefer_reference: why "auto" keeps the reference for this call's shape or format (the kernel measured slower
    there, or not measured there; AUTO_KEEPS_REFERENCE says it for an op as a whole). Only "auto" heeds it (logged once per reason); a backend
    named by FNX_KERNELS, `force` or impl runs as named."""
    if impl in (None, "auto") and _mesh.get() is not None and op not in MESH_READY:
        return "reference"
    if impl in (None, "auto"):
        forced = _forced.get() or env_choice(op)
        if forced:
            if forced not in supported:
                raise ValueError(f"FNX_KERNELS={forced!r}: {op} supports {supported}")
            if not_applicable is not None:
                forced = "reference"
            return resolve(op, forced, supported=supported)
        choice = "pallas" if "pallas" in supported and why_unavailable("pallas") is None else "reference"
        if not_applicable is not None:
            choice = "reference"
        if choice == "pallas" and op not in VERIFIED_ON_GPU:
            if (op, "unverified") not in _logged:
                _logged.add((op, "unverified"))
                log.warning("fnx kernel %s: its compiled kernel has not passed its GPU tests yet, so 'auto' runs "
                            "the reference; FNX_KERNELS=%s=pallas opts in", op, op)
            choice = "reference"
        elif choice == "pallas" and op in AUTO_KEEPS_REFERENCE:
            if (op, "kept") not in _logged:
                _logged.add((op, "kept"))
                log.info("fnx kernel %s: 'auto' runs the reference (%s); FNX_KERNELS=%s=pallas opts in", op,
                         AUTO_KEEPS_REFERENCE[op], op)
            choice = "reference"
        elif choice == "pallas" and prefer_reference is not None:
            if (op, prefer_reference) not in _logged:
                _logged.add((op, prefer_reference))
                log.info("fnx kernel %s: 'auto' runs the reference for this call (%s); FNX_KERNELS=%s=pallas opts "
                         "in", op, prefer_reference, op)
            choice = "reference"
    else:
        if impl not in supported:
            raise ValueError(f"{op}: unknown implementation {impl!r}; choose one of {('auto',) + supported}")
        reason = why_unavailable(impl)
        if reason is not None:
            raise ValueError(f"{op}: implementation {impl!r} cannot run here: {reason}")
        if impl != "reference" and not_applicable is not None:
            raise NotApplicable(f"{op}: the {impl!r} kernel does not apply to this call: {not_applicable}; "
                                "use impl='reference' (auto picks it for such calls)")
        choice = impl
    if (op, choice) not in _logged:
        _logged.add((op, choice))
        log.info("fnx kernel %s: using %s", op, choice)
    return choice


def fields_override(spec: str, cls, what: str, text_fields: tuple[str, ...] = ()) -> dict:
    """"field=value,..." -> {field: value} for fields of the dataclass `cls` (the ones in `text_fields` as text, the
    others integers): the tile knobs of benchmarks (`FNX_MOE_TOKENS_TILES`, `FNX_HC_FEW_TILES`). `what` names the
    knob in the errors."""
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or key not in names:
            raise ValueError(f"{what}: {part!r} is not field=value with a {cls.__name__} field ({', '.join(names)})")
        try:
            out[key] = val.strip() if key in text_fields else int(val)
        except ValueError:
            raise ValueError(f"{what}: {key} takes an integer, got {val!r}") from None
    return out


def env_choice(op: str) -> str | None:
    """The backend FNX_KERNELS names for `op`, or None."""
    spec = os.environ.get("FNX_KERNELS", "").strip()
    if not spec:
        return None
    if "=" not in spec:
        return spec
    choice = None
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"FNX_KERNELS={spec!r}: {part!r} is not op=backend")
        if name.strip() not in KNOWN_OPS:
            import difflib
            near = [o for o in KNOWN_OPS if o.startswith(name.strip())] or \
                difflib.get_close_matches(name.strip(), KNOWN_OPS, n=1)
            raise ValueError(f"FNX_KERNELS={spec!r}: no op is named {name.strip()!r}"
                             f"{f' (did you mean {near[0]!r}?)' if near else ''}; the ops: {', '.join(KNOWN_OPS)}")
        if name.strip() == op:
            choice = value.strip()
    return choice


def named_choice(op: str) -> str | None:
    """The backend FNX_KERNELS names for `op` by its name ("op=backend"), or None: for ops that are another design of
    a call some other op already serves (the one-launch HC boundaries), which one backend for every op
    (FNX_KERNELS=pallas, `force`) does not switch on."""
    spec = os.environ.get("FNX_KERNELS", "").strip()
    return env_choice(op) if "=" in spec else None


def interpret_flag(backend: str) -> bool:
    """The `interpret=` argument for pl.pallas_call given a resolved Pallas backend."""
    if backend not in ("pallas", "pallas_interpret"):
        raise ValueError(f"{backend!r} is not a Pallas backend")
    return backend == "pallas_interpret"


HOST_MEMORY_BACKENDS = ("pallas", "pallas_interpret", "reference")


def host_memory_impl(op: str, impl: str | None, mem) -> str:
    """The backend of an op whose kernels reach page-locked host memory at real addresses (uva_gather, ple_ring):
    "pallas" with real addresses (mem None; only on CUDA, else RuntimeError saying why), "reference" or
    "pallas_interpret" with a stand-in memory `mem` whose byte offsets play the addresses (the CPU tests). impl
    None picks by `mem`. A backend that cannot take what it is given raises ValueError."""
    impl = impl or ("pallas" if mem is None else "reference")
    if impl not in HOST_MEMORY_BACKENDS:
        raise ValueError(f"{op} backend must be one of {HOST_MEMORY_BACKENDS}, got {impl!r}")
    if mem is None:
        if impl != "pallas":
            raise ValueError(f"{op}: backend {impl!r} reads a stand-in memory; real host addresses need the "
                             "compiled kernel ('pallas')")
        why = why_unavailable("pallas")
        if why:
            raise RuntimeError(f"{op} reaches page-locked host memory from a CUDA kernel, which cannot run here: "
                               f"{why}. Keep the PLE table in 'device', 'pinned' or 'pageable' mode instead")
    elif impl == "pallas":
        raise ValueError(f"{op}: the compiled kernel reads real addresses; a stand-in memory runs 'reference' or "
                         "'pallas_interpret'")
    return impl
