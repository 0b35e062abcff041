"""The hyper-connection boundary in one launch: one token (op "hc_boundary_one"), a few (op "hc_boundary_few_one").

`pallas.hc_boundary_m1` runs a boundary as two kernels because every gate of its up half needs all r values of the
down half's output. Here one launch of P resident programs does both, with a grid-wide barrier between them
(`fnx.pallas.grid_sync`): each program first takes the down kernel's tasks p, p + P, ... (a task is one program of
`hc_down1`: a block of bn rows of [Wdown; Winj] over one stream), stores their partial sums and each stream's rstd,
waits at the barrier for every program, then takes up1's tasks the same way (a task: bd output columns of every
stream). Plain loads read the partials other programs wrote in this launch: the barrier's acquire-release atomic
and the thread barriers after it order them after those stores (the PTX memory model; an acquire invalidates the
SM's L1 for later loads). The tasks are the two kernels' own code (`pallas._down1_task`, `pallas._up1_task`), so the
results are theirs bit for bit.

P programs must all be resident at once: P defaults to two per SM of the device (at most the down tasks), and a
named P (`TilesOne.programs`, `FNX_HC_ONE_TILES`) may take up to five per SM. A program that waits too long at the
barrier (a co-residency failure) writes NaN in its x columns instead of hanging. The Pallas interpreter runs
programs one after another, so on the CPU one launch runs with P = 1; `launches=2` runs the same task loops as two
launches with no barrier (any P: how the tests check the task split on the CPU).

The counter comes from the caller (`sync` and `sync_index`: the api takes one of the decode program's
`grid_sync.CounterPool`, which the model makes once per program, `transformer.make_meta`); without it this call makes
its own (one launch more).

A few tokens (2..8, an MTP verify window: `hc_boundary_one_few`, op "hc_boundary_few_one") run in three phases
with two barriers: a down task (a block of bn rows of [Wdown; Winj], one stream, kc chunks of bk of its columns)
multiplies round(H' (1 + w)) of every token (padded to 16 MMA rows, the padding masked) by its rows on the tensor
cores and stores the split's fp32 partials and each token's sum of H'^2 over those columns; a mid task sums, for bm
rows and every token, each stream's splits times the token's 1/rms over the stream (the one-token kernels' `fold`
arithmetic), then the streams, and stores u = silu(round(. / S)) (inj's rows: 2 sigmoid); an up task multiplies u
by bd rows of Wup per stream on the tensor cores and mixes the gated Hn of its columns. The first form had each
down task walk its stream's whole D (84 tasks of 20 chunks at the released shapes) and `hc_up1`'s tasks walk the
tokens (silu and the stream sum redone per task, shared-memory layout changes: 165 CTA barriers per task in the
stock build): 53 us a five-token boundary on the H100; with the down tasks split alone, 35 us; this form 30.7 us,
where the XLA boundary it would replace (the combine, the norm, the down kernel, its split sum, silu, the up GEMV
and the mix: 7-8 launches) takes ~16: off (dispatch.AUTO_KEEPS_REFERENCE)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import dispatch, grid_sync, stacked
from fnx.pallas.hc import pallas as kernel
from fnx.pallas.kernel_math import rnd

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST   # fp32 operands (the tests' fp32 runs): IEEE products; bf16: no effect
MP = 16                               # token rows of each MMA (the real tokens first, the rest masked)
MAX_FEW = 8
PROGRAMS_PER_SM = 2            # the default P per SM
MAX_PROGRAMS_PER_SM = 5        # the most a named P may ask (the stock sm_90 build: 96 registers a thread at 4 warps,
                               # so five programs fit an SM's 64K registers; the polling bound catches a wrong guess).
                               # Why more than the default: a program walks its tasks one after another (each a memory
                               # round trip), where the two kernels keep ~5 programs of one task each in flight per SM
TILES_ENV = "FNX_HC_ONE_TILES"


@dataclasses.dataclass(frozen=True)
class TilesOne:
    programs: int = 0           # resident programs P (0: PROGRAMS_PER_SM per SM of the device, at most the down tasks)
    max_polls: int = grid_sync.MAX_POLLS


def choose_tiles() -> TilesOne:
    """The defaults; `FNX_HC_ONE_TILES` ("field=value,...", read when a program is traced: a benchmark knob)
    replaces fields."""
    t = TilesOne()
    spec = os.environ.get(TILES_ENV, "").strip()
    if spec:
        t = dataclasses.replace(t, **dispatch.fields_override(spec, TilesOne, TILES_ENV))
    return t


def sm_count() -> int | None:
    """The first device's SM count (None where JAX does not say: the CPU)."""
    try:
        dev = jax.devices()[0]
    except Exception:  # pragma: no cover
        return None
    n = getattr(dev, "core_count", None)
    return int(n) if dev.platform == "gpu" and n else None


def resolve_programs(t: TilesOne, tasks: int, interpret: bool, launches: int, op: str = "hc_boundary_one") -> int:
    """P for these tiles: checked against the device (all programs must be resident at once in one launch). op: the
    op the errors name."""
    if t.programs < 0:
        raise ValueError(f"{op}: programs={t.programs} (0 for the default, else a count)")
    sms = sm_count()
    if launches == 1 and interpret:
        if t.programs not in (0, 1):
            raise ValueError(f"{op}: programs={t.programs} in one launch under the Pallas interpreter, "
                             "which runs programs one after another (the barrier would wait forever): programs=1, "
                             "or launches=2")
        return 1
    if t.programs == 0:
        return min(tasks, PROGRAMS_PER_SM * sms) if sms else min(tasks, 8)
    if launches == 1 and sms and t.programs > MAX_PROGRAMS_PER_SM * sms:
        raise ValueError(f"{op}: programs={t.programs} > {MAX_PROGRAMS_PER_SM} per SM of {sms} SMs: "
                         "all of one launch's programs must be resident at once for its barrier")
    return t.programs


def _kernel_refs(refs, has_y: bool, has_inj: bool, fp8: bool, phases: str):
    """The one-launch kernels' refs in their order: (down1's inputs, Wup, its scales, the counter (phases "both"),
    the outputs (x, H', inj; None where absent or not this phase's), the scratch (partials, rstd: outputs of the
    down phase, inputs of the up phase))."""
    it = iter(refs)
    down_in = kernel._down1_inputs(it, has_y, has_inj, fp8)
    wu_ref = next(it)
    su_ref = next(it) if fp8 else None
    scratch = (next(it), next(it)) if phases == "up" else None
    sync_ref = next(it) if phases == "both" else None
    outs = (None, None, None)
    if phases != "down":
        outs = (next(it), next(it) if has_y else None, next(it) if has_inj else None)
    if phases != "up":
        scratch = (next(it), next(it))
    return down_in, wu_ref, su_ref, sync_ref, outs, scratch


def _one_kernel(*refs, s, d, r, bn, bd, ch, q, eps, has_y, has_inj, fp8, wround, fold, early, down_pieces,
                up_pieces, n_down_tasks, n_prog_rows, programs, phases, max_polls, interpret, sync_index):
    """phases "both" (one launch, the barrier between), "down" or "up" (two launches)."""
    down_in, wu_ref, su_ref, sync_ref, (x_ref, ho_ref, injo_ref), (part_ref, rstd_ref) = _kernel_refs(
        refs, has_y, has_inj, fp8, phases)
    h_ref, y_ref, inj_ref, wn_ref = down_in[:4]
    p = pl.program_id(0)
    n_rows = n_prog_rows * bn

    if phases != "up":
        def down(task):
            n, j = task // s, task % s

            def store_rstd(rstd):
                plt.store(rstd_ref.at[jnp.full((1, 1), n * s + j, jnp.int32)], rstd)
            _, accs = kernel._down1_task(*down_in, n, j, [0], store_rstd, s=s, d=d, r=r, bn=bn, ch=ch, q=q, eps=eps,
                                         has_y=has_y, has_inj=has_inj, fp8=fp8, pieces=down_pieces, wround=wround,
                                         fold=fold)
            plt.store(part_ref.at[j * n_rows + n * bn + jnp.arange(bn, dtype=jnp.int32)], accs[0])
        _tasks(p, programs, n_down_tasks, down)
    if phases == "down":
        return
    ok = grid_sync.barrier(sync_ref, programs, max_polls, interpret, sync_index) if phases == "both" else None
    _up_phase(p, programs, ok, part_ref, rstd_ref, h_ref, y_ref, inj_ref, wn_ref, wu_ref, su_ref, x_ref, ho_ref,
              injo_ref, s=s, d=d, r=r, bd=bd, n_rows=n_rows, has_y=has_y, has_inj=has_inj, fp8=fp8,
              pieces=up_pieces, wround=wround, early=early)


def _tasks(p, programs: int, n_tasks: int, run):
    """run(task) for this program's tasks p, p + programs, ... below n_tasks (a loop; the last round masked)."""
    def body(k, carry):
        task = p + k * programs

        @pl.when(task < n_tasks)
        def _():
            run(task)
        return carry
    lax.fori_loop(0, -(-n_tasks // programs), body, 0)


def _up_phase(p, programs, ok, part_ref, rstd_ref, h_ref, y_ref, inj_ref, wn_ref, wu_ref, su_ref, x_ref, ho_ref,
              injo_ref, *, s, d, r, bd, n_rows, has_y, has_inj, fp8, pieces, wround, early):
    """hc_up1's tasks for the one token (bd output columns of every stream) for program p, storing its x, H' and
    (task 0) inj; `ok` False (a program that gave up at the barrier): NaN in its x."""
    dt = h_ref.dtype
    sj = jnp.arange(s, dtype=jnp.int32)

    def up(i):
        xs, hos = kernel._up1_task(part_ref, rstd_ref, h_ref, y_ref, inj_ref, wn_ref, wu_ref, su_ref, i,
                                   lambda: [0], 1, sj, s=s, d=d, r=r, bd=bd, n_rows=n_rows, has_y=has_y, fp8=fp8,
                                   pieces=pieces, wround=wround, early=early)
        cols = i * bd + jnp.arange(bd, dtype=jnp.int32)
        x = xs[0] if ok is None else jnp.where(ok, xs[0], jnp.nan)
        plt.store(x_ref.at[cols], x.astype(dt))
        if has_y:
            plt.store(ho_ref.at[sj[:, None] * d + cols[None, :]], hos[0].astype(dt))
        if has_inj:
            @pl.when(i == 0)
            def _():
                plt.store(injo_ref.at[sj], kernel._up1_inj(part_ref, [0], sj, s=s, n_rows=n_rows, r=r,
                                                            dt=dt)[0].astype(dt))
    _tasks(p, programs, d // bd, up)


def hc_boundary_one(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float,
                    sync=None, sync_index: int = 0, interpret: bool = False, tiles1: kernel.Tiles1 | None = None,
                    tiles: TilesOne | None = None, launches: int = 1, w_down_scale=None, w_up_scale=None):
    """`hc_boundary` for one token (h [..., S*D] with one token in its leading dims) in one launch (see the
    module's note); the arguments and results of `pallas.hc_boundary_m1`, whose tiles (`tiles1`) the tasks take,
    plus `sync` (int32 counters, the barrier's at `sync_index`: a `grid_sync.CounterPool`'s, or None: one is made
    here) and `tiles` (TilesOne). launches=2: the same
    task loops as two launches without the barrier (tests)."""
    dt = h.dtype
    lead, sd, s, d, r, m = kernel.boundary_dims(h, w_down, streams, 1, "hc_boundary_one")
    t1 = tiles1 or kernel.choose_tiles1(s, d, r)
    if s != kernel._pow2(s) or r % t1.bn or s % t1.bn or d % t1.bd:
        raise ValueError(f"hc_boundary_one: S={s} (a power of two), r={r}, D={d} do not fit the tiles {t1}")
    fp8 = kernel.check_fp8_scales("hc_boundary_one", r, sd, w_down_scale, w_up_scale)
    if fp8 and (128 % t1.bn or 128 % t1.bd):
        raise ValueError(f"hc_boundary_one FP8: bn={t1.bn} and bd={t1.bd} must divide the 128-row blocks")
    if launches not in (1, 2):
        raise ValueError(f"hc_boundary_one: launches={launches} (1, or 2 for the tests' split)")
    has_y, has_inj = y is not None, w_inj is not None
    n_prog_rows = r // t1.bn + (s // t1.bn if has_inj else 0)
    n_down_tasks = n_prog_rows * s
    t = tiles or choose_tiles()
    programs = resolve_programs(t, n_down_tasks, interpret, launches)
    ch = kernel._largest_pow2_divisor(d, 128)
    ins = _operands(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, w_down_scale, w_up_scale)
    scratch = [jax.ShapeDtypeStruct((s * n_prog_rows * t1.bn,), F32), jax.ShapeDtypeStruct((n_prog_rows * s,), F32)]
    outs = [jax.ShapeDtypeStruct((d,), dt)] + ([jax.ShapeDtypeStruct((s * d,), dt)] if has_y else []) + (
        [jax.ShapeDtypeStruct((s,), dt)] if has_inj else [])
    body = functools.partial(
        _one_kernel, s=s, d=d, r=r, bn=t1.bn, bd=t1.bd, ch=ch, q=d // ch, eps=eps, has_y=has_y, has_inj=has_inj,
        fp8=fp8, wround=bool(t1.wround), fold=bool(t1.fold), early=bool(t1.early),
        down_pieces=tuple(kernel._down_pieces(d // ch, t1.pieces)), up_pieces=tuple(kernel._up_pieces(r, t1.pieces)),
        n_down_tasks=n_down_tasks, n_prog_rows=n_prog_rows, programs=programs, max_polls=t.max_polls,
        interpret=interpret, sync_index=sync_index)
    return _launch(body, "hc_boundary1" + ("_fp8" if fp8 else ""), ins, outs, scratch, programs=programs,
                   launches=launches, sync=sync, sync_index=sync_index, interpret=interpret,
                   num_warps=t1.num_warps, num_stages=t1.num_stages, h=h, lead=lead, d=d, s=s, has_y=has_y,
                   has_inj=has_inj)


def _operands(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, w_down_scale, w_up_scale) -> tuple:
    """The kernels' inputs in their order (each flattened; a layer of a stack stays a view): h, [y, inj_prev],
    hc_norm, Wdown, [its scales], [Winj], Wup, [its scales]."""
    flat = stacked.flatten
    f32 = lambda a: stacked.astype(a, F32)  # noqa: E731
    return (flat(h),) + ((flat(y), flat(inj_prev)) if y is not None else ()) + (flat(hc_norm), flat(w_down)) + (
        (flat(f32(w_down_scale)),) if w_down_scale is not None else ()) + (
        (flat(w_inj),) if w_inj is not None else ()) + (flat(w_up),) + (
        (flat(f32(w_up_scale)),) if w_up_scale is not None else ())


def _phase_caller(body, name: str, key: str, whole: str, *, programs: int, interpret: bool, num_warps: int,
                  num_stages: int):
    """call(phase, args, out_shape): `body` with `key` = phase over `programs` programs, all operands whole; the
    launch is named `name`, or name_<phase> for a phase of a split run (phase != `whole`)."""
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    spec = pl.BlockSpec(memory_space=pl.ANY)

    def call(phase, args, out_shape):
        return stacked.call(functools.partial(body, **{key: phase}), args, grid=(programs,),
                            in_specs=[spec] * len(args), out_specs=[spec] * len(out_shape), out_shape=out_shape,
                            interpret=interpret, name=name + ("" if phase == whole else "_" + phase), **params)
    return call


def _counter(sync, sync_index: int, interpret: bool, name: str):
    """The barrier's counters: `sync` (checked to hold counter `sync_index`), or a fresh counter when None."""
    if sync is None:
        sync = grid_sync.counter(interpret)
    if not 0 <= sync_index < sync.shape[0]:
        raise ValueError(f"{name}: the barrier's counter {sync_index} is outside the counters {sync.shape}")
    return sync


def _launch(body, name, ins, outs, scratch, *, programs, launches, sync, sync_index, interpret, num_warps, num_stages,
            h, lead, d, s, has_y, has_inj):
    """The kernel `body` over `programs` programs: one launch with the barrier (phases "both"; `sync` the counter,
    made here when None), or (launches=2) the down phase, then the up phase reading its scratch. Returns
    (H', x, inj) shaped as the caller's h."""
    call = _phase_caller(body, name, "phases", "both", programs=programs, interpret=interpret, num_warps=num_warps,
                         num_stages=num_stages)
    if launches == 1:
        res = call("both", ins + (_counter(sync, sync_index, interpret, name),), outs + scratch)
    else:
        part, rstd = call("down", ins, scratch)
        res = call("up", ins + (part, rstd), outs)
    x = res[0].reshape(*lead, d)
    h_new = res[1].reshape(h.shape) if has_y else h
    inj = res[1 + has_y].reshape(*lead, s) if has_inj else None
    return h_new, x, inj


# ---- a few tokens (2..MAX_FEW) --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TilesFewOne:
    bn: int = 64            # rows of [Wdown; Winj] per down task (the MMA's N: a power of two in 16..128; the rows
                            # past r masked, Winj's S rows in blocks of their own after Wdown's)
    bk: int = 128           # columns per MMA chunk (a power of two in 16..128 dividing D: a chunk in one FP8 block;
                            # the defaults take the largest that divides D)
    kc: int = 1             # chunks per down task: a task multiplies kc * bk columns of one stream (kc divides D / bk;
                            # more than 1: a loop Triton pipelines `num_stages` deep). The first form walked a
                            # stream's whole D per task (20 chunks at the released shapes, 84 tasks): 53 us a
                            # five-token boundary on the H100 (2026-12-05, 727fea1), a memory round trip per chunk
    bm: int = 8             # mid tasks: rows of [r + S] per task (a power of two in 8..128)
    bd: int = 16            # up tasks: output columns of every stream per task (the MMA's N: a power of two in
                            # 16..128 dividing D and 128)
    num_warps: int = 4
    num_stages: int = 2     # the down task's chunk loop (kc > 1): loads Triton keeps in flight ahead of the MMA
    programs: int = 0       # resident programs P (0: PROGRAMS_PER_SM per SM, at most the largest phase's tasks)
    max_polls: int = grid_sync.MAX_POLLS
    split: int = 0          # 1: the three phases as three launches of P programs, no barrier (a diagnostic: each
                            # phase's time on its own in a kernel table; the same values)


FEW_TILES_ENV = "FNX_HC_FEW_ONE_TILES"


def few_tiles(d: int, r: int) -> TilesFewOne:
    """TilesFewOne's defaults; `FNX_HC_FEW_ONE_TILES` ("field=value,...", read when a program is traced) replaces
    fields."""
    bk = 128
    while bk > 16 and d % bk:
        bk //= 2
    t = TilesFewOne(bk=bk)
    spec = os.environ.get(FEW_TILES_ENV, "").strip()
    if spec:
        t = dataclasses.replace(t, **dispatch.fields_override(spec, TilesFewOne, FEW_TILES_ENV))
    return t


def check_few(s: int, d: int, r: int, t: TilesFewOne) -> str | None:
    """None when the tiles fit S streams of D at rank r, else why not."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    if not (pow2(t.bn) and 16 <= t.bn <= 128):
        return f"bn={t.bn}: a power of two in 16..128"
    if not (pow2(t.bk) and 16 <= t.bk <= 128) or d % t.bk:
        return f"bk={t.bk}: a power of two in 16..128 dividing D={d}"
    if t.kc < 1 or (d // t.bk) % t.kc:
        return f"kc={t.kc}: a divisor of D / bk = {d // t.bk} chunks"
    if not (pow2(t.bm) and 8 <= t.bm <= 128):
        return f"bm={t.bm}: a power of two in 8..128"
    if not (pow2(t.bd) and 16 <= t.bd <= 128) or d % t.bd:
        return f"bd={t.bd}: a power of two in 16..128 dividing D={d}"
    if not pow2(s):
        return f"S={s} streams: a power of two (the streams are a tile axis)"
    return None


def _down_split_task(h_ref, y_ref, inj_ref, wn_ref, wd_ref, sd_ref, wi_ref, n, j, c, *, m, s, d, r, bn, bk, kc, has_y,
                     has_inj, fp8):
    """Rows block n of [Wdown; Winj] (bn rows; the blocks past Wdown's hold Winj's S rows, the rest masked) times
    chunks [c*kc, (c+1)*kc) of stream j of every token: ([MP, bn] fp32 row sums of round(H' (1 + w)) (FP8: each
    chunk's product times its block scale; no 1/rms yet), each token's sum of H'^2 over those columns [MP], the
    rows' places in [r + S], which of them are real)."""
    dt = h_ref.dtype
    sd = s * d
    tok = jnp.arange(MP, dtype=jnp.int32)
    treal = tok < m
    rows = jnp.arange(bn, dtype=jnp.int32)
    kk = jnp.arange(bk, dtype=jnp.int32)
    n_down = -(-r // bn)
    is_down = n < n_down
    drow = n * bn + rows
    irow = (n - n_down) * bn + rows
    dok = (drow < r) & is_down
    iok = (irow < s) & jnp.logical_not(is_down)
    ncb = (sd + 127) // 128
    injv = plt.load(inj_ref.at[tok * s + j], mask=treal, other=0.0).astype(F32)[:, None] if has_y else None

    def chunk(ci, carry):
        acc, ss = carry
        dcol = ci * bk + kk                                 # columns within the stream
        col = j * d + dcol                                  # columns of S*D
        w = plt.load(wd_ref.at[drow[:, None] * sd + col[None, :]], mask=dok[:, None], other=0.0).astype(dt)
        if has_inj:         # one of the two loads touches no memory
            w = w + plt.load(wi_ref.at[irow[:, None] * sd + col[None, :]], mask=iok[:, None], other=0.0).astype(dt)
        hc = plt.load(h_ref.at[tok[:, None] * sd + col[None, :]], mask=treal[:, None], other=0.0).astype(F32)
        if has_y:
            yv = plt.load(y_ref.at[tok[:, None] * d + dcol[None, :]], mask=treal[:, None], other=0.0).astype(F32)
            hc = rnd(hc + rnd(yv * injv, dt), dt)
        wn = plt.load(wn_ref.at[col]).astype(F32)
        x = (hc * (1.0 + wn)[None, :]).astype(dt)
        p = jnp.dot(x, w.T, precision=HIGHEST, preferred_element_type=F32)                 # [MP, bn]
        if fp8:     # the block's rows lie in one 128-row block, the chunk in one 128-column block; Winj: 1
            sc = plt.load(sd_ref.at[jnp.full((1, 1), (n * bn) // 128 * ncb + (j * d + ci * bk) // 128, jnp.int32)],
                          mask=jnp.full((1, 1), is_down), other=1.0)
            p = p * sc
        return acc + p, ss + jnp.sum(hc * hc, axis=1)
    init = (jnp.zeros((MP, bn), F32), jnp.zeros((MP,), F32))
    acc, ss = chunk(c, init) if kc == 1 else lax.fori_loop(c * kc, (c + 1) * kc, chunk, init)
    return acc, ss, jnp.where(is_down, drow, r + irow), dok | iok


def _few_refs(refs, has_y: bool, has_inj: bool, fp8: bool, phase: str):
    """The few-token kernel's refs by phase: (down's inputs, Wup, its scales, the counter (phase "all"), x, H', inj
    (None where absent or not this phase's outputs), the split partials and sums of squares (the down phase's
    outputs, the mid's inputs), u and rstd (the mid's outputs, the up's inputs))."""
    it = iter(refs)
    down_in = kernel._down1_inputs(it, has_y, has_inj, fp8)
    wu_ref = next(it)
    su_ref = next(it) if fp8 else None
    sync_ref = next(it) if phase == "all" else None
    split = (next(it), next(it)) if phase == "mid" else (None, None)
    gates = (next(it), next(it)) if phase == "up" else (None, None)
    x_ref = ho_ref = injo_ref = None
    if phase in ("all", "up"):
        x_ref = next(it)
        ho_ref = next(it) if has_y else None
    if phase in ("all", "mid") and has_inj:
        injo_ref = next(it)
    if phase in ("all", "down"):
        split = (next(it), next(it))
    if phase in ("all", "mid"):
        gates = (next(it), next(it))
    return down_in, wu_ref, su_ref, sync_ref, (x_ref, ho_ref, injo_ref), split, gates


def _few_one_kernel(*refs, m, mp, s, d, r, bn, bk, kc, bm, bd, eps, has_y, has_inj, fp8, up_pieces, n_blocks, programs,
                    phase, max_polls, interpret, sync_index):
    """phase "all" (one launch, a barrier after the down and after the mid tasks), or "down", "mid", "up" (three
    launches)."""
    down_in, wu_ref, su_ref, sync_ref, (x_ref, ho_ref, injo_ref), (splt_ref, ssq_ref), (u_ref, rstd_ref) = \
        _few_refs(refs, has_y, has_inj, fp8, phase)
    h_ref, y_ref, inj_ref, wn_ref, wd_ref, sd_ref, wi_ref = down_in
    dt = h_ref.dtype
    p = pl.program_id(0)
    n_rows = r + s
    nc = d // (bk * kc)                 # splits per stream
    ncp = kernel._pow2(nc)
    tok = jnp.arange(MP, dtype=jnp.int32)

    if phase in ("all", "down"):
        def down(task):
            n, jc = task // (s * nc), task % (s * nc)
            j, c = jc // nc, jc % nc
            acc, ss, rows, rok = _down_split_task(h_ref, y_ref, inj_ref, wn_ref, wd_ref, sd_ref, wi_ref, n, j, c, m=m,
                                                  s=s, d=d, r=r, bn=bn, bk=bk, kc=kc, has_y=has_y, has_inj=has_inj,
                                                  fp8=fp8)
            # split partials [S * nc, M, r + S], sums of squares [S * nc, M]
            plt.store(splt_ref.at[(jc * m + tok[:, None]) * n_rows + rows[None, :]], acc,
                      mask=(tok < m)[:, None] & rok[None, :])
            plt.store(ssq_ref.at[jc * m + tok], ss, mask=(tok < m) & (n == 0))
        _tasks(p, programs, n_blocks * s * nc, down)
    if phase == "down":
        return
    ok = grid_sync.barrier(sync_ref, programs, max_polls, interpret, sync_index) if phase == "all" else None

    if phase in ("all", "mid"):
        cs = jnp.arange(ncp, dtype=jnp.int32)
        ts = jnp.arange(mp, dtype=jnp.int32)
        rr = jnp.arange(bm, dtype=jnp.int32)
        ct = (cs[:, None] < nc) & (ts[None, :] < m)                                        # [ncp, mp]

        def mid(b):     # rows [b*bm, (b+1)*bm) of [r + S] for every token: each stream's splits times its 1/rms,
            row = b * bm + rr   # summed over the streams, / S, then silu (Wdown's rows: u) or 2 sigmoid (Winj's: inj)
            ok3 = ct[:, :, None] & (row < n_rows)[None, None, :]
            v, rstds = None, []
            for j in range(s):
                ss = plt.load(ssq_ref.at[(j * nc + cs[:, None]) * m + ts[None, :]], mask=ct, other=0.0)
                rstd = lax.rsqrt(jnp.sum(ss, axis=0) / d + eps)                             # [mp]
                parts = plt.load(splt_ref.at[((j * nc + cs[:, None, None]) * m + ts[None, :, None]) * n_rows
                                             + row[None, None, :]], mask=ok3, other=0.0)   # [ncp, mp, bm]
                vj = jnp.sum(parts, axis=0) * rstd[:, None]                                 # [mp, bm]
                v = vj if v is None else v + vj
                rstds.append(rstd)
            val = rnd(rnd(v, dt) / s, dt)
            sig = rnd(jax.nn.sigmoid(val), dt)
            tm = (ts < m)[:, None]
            plt.store(u_ref.at[ts[:, None] * r + row[None, :]], rnd(val * sig, dt), mask=tm & (row < r)[None, :])
            if has_inj:
                irow = row - r
                plt.store(injo_ref.at[ts[:, None] * s + irow[None, :]], (2.0 * sig).astype(dt),
                          mask=tm & ((irow >= 0) & (irow < s))[None, :])

            @pl.when(b == 0)
            def _():
                for j in range(s):      # rstd [S, Mp]
                    plt.store(rstd_ref.at[j * mp + ts], rstds[j], mask=ts < m)
        _tasks(p, programs, -(-n_rows // bm), mid)
    if phase == "mid":
        return
    if phase == "all":
        ok = ok & grid_sync.barrier(sync_ref, programs, max_polls, interpret, sync_index)

    ncb = (r + 127) // 128
    treal = tok < m

    def up(i):      # output columns [i*bd, (i+1)*bd) of every stream: the gates on the tensor cores, then the mix
        cols = i * bd + jnp.arange(bd, dtype=jnp.int32)
        z = [None] * s
        for k0, pw in up_pieces:
            k = k0 + jnp.arange(pw, dtype=jnp.int32)
            kok = (k < r)[None, :]          # (r rounded up to 16: the MMA's K)
            ut = plt.load(u_ref.at[tok[:, None] * r + k[None, :]], mask=treal[:, None] & kok, other=0.0).astype(dt)
            for j in range(s):
                w = plt.load(wu_ref.at[(j * d + cols)[:, None] * r + k[None, :]], mask=kok, other=0.0
                             ).astype(dt)                                                           # [bd, pw]
                zp = jnp.dot(ut, w.T, precision=HIGHEST, preferred_element_type=F32)            # [MP, bd]
                if fp8:     # the stream's bd rows in one 128-row block, the piece in one 128-column block
                    zp = zp * plt.load(su_ref.at[jnp.full((1, 1), ((j * d + i * bd) // 128) * ncb + k0 // 128,
                                                          jnp.int32)])
                z[j] = zp if z[j] is None else z[j] + zp
        x = jnp.zeros((MP, bd), F32)
        for j in range(s):
            hc = plt.load(h_ref.at[tok[:, None] * (s * d) + j * d + cols[None, :]], mask=treal[:, None], other=0.0)
            if has_y:
                yv = plt.load(y_ref.at[tok[:, None] * d + cols[None, :]], mask=treal[:, None], other=0.0).astype(F32)
                injp = plt.load(inj_ref.at[tok * s + j], mask=treal, other=0.0).astype(F32)
                hc = (hc.astype(F32) + rnd(injp[:, None] * yv, dt)).astype(dt)
                plt.store(ho_ref.at[tok[:, None] * (s * d) + j * d + cols[None, :]], hc, mask=treal[:, None])
            rstd = plt.load(rstd_ref.at[j * mp + tok], mask=treal, other=1.0)
            wn = plt.load(wn_ref.at[j * d + cols]).astype(F32)
            hn = rnd(hc.astype(F32) * rstd[:, None] * (1.0 + wn)[None, :], dt)
            mg = rnd(jax.nn.sigmoid(rnd(z[j], dt)), dt)
            x = x + rnd(mg * hn, dt)
        x = x / s
        if ok is not None:
            x = jnp.where(ok, x, jnp.nan)
        plt.store(x_ref.at[tok[:, None] * d + cols[None, :]], x.astype(dt), mask=treal[:, None])
    _tasks(p, programs, d // bd, up)


def few_tasks(s: int, d: int, r: int, t: TilesFewOne, has_inj: bool = True) -> tuple[int, int, int]:
    """(down, mid, up) task counts of a few-token boundary (S streams of D, rank r) in these tiles."""
    n_blocks = -(-r // t.bn) + (-(-s // t.bn) if has_inj else 0)
    return n_blocks * s * (d // (t.bk * t.kc)), -(-(r + s) // t.bm), d // t.bd


def hc_boundary_one_few(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float,
                        sync=None, sync_index: int = 0, interpret: bool = False, tiles: TilesFewOne | None = None,
                        launches: int = 1, w_down_scale=None, w_up_scale=None):
    """`hc_boundary` for 2..MAX_FEW tokens (h [..., S*D]) in one launch: P programs take the down tasks (a block of
    bn rows of [Wdown; Winj], one stream, kc * bk of its columns: split partials and sums of squares), wait at the
    grid barrier, take the mid tasks (bm rows of [Wdown; Winj] for every token: each stream's splits summed and
    scaled by the token's 1/rms over that stream, summed over the streams, / S, then silu: u, or 2 sigmoid: inj),
    wait again, then take the up tasks (bd columns of every stream: the gates round(u @ Wup.T) as tensor-core
    products over every token, sigmoid, and the mix with Hn formed from H' and its rstd). The arguments and results
    of `pallas.hc_boundary_m1`, plus `sync` / `sync_index` (as `hc_boundary_one`'s; the two barriers count on the
    same counter) and `tiles` (TilesFewOne). launches=3: the same task loops as three launches without the barriers
    (tests; `TilesFewOne.split`)."""
    dt = h.dtype
    lead, sd, s, d, r, m = kernel.boundary_dims(h, w_down, streams, MAX_FEW, "hc_boundary_one_few")
    t = tiles or few_tiles(d, r)
    why = check_few(s, d, r, t)
    if why:
        raise ValueError(f"hc_boundary_one_few: S={s} D={d} r={r} do not fit {t}: {why}")
    fp8 = kernel.check_fp8_scales("hc_boundary_one_few", r, sd, w_down_scale, w_up_scale)
    if launches not in (1, 3):
        raise ValueError(f"hc_boundary_one_few: launches={launches} (1, or 3 for the tests' split)")
    if t.split:
        launches = 3
    has_y, has_inj = y is not None, w_inj is not None
    n_blocks = -(-r // t.bn) + (-(-s // t.bn) if has_inj else 0)
    mp = kernel._pow2(m)
    programs = resolve_programs(TilesOne(programs=t.programs), max(few_tasks(s, d, r, t, has_inj)), interpret,
                                1 if launches == 1 else 2, "hc_boundary_few_one")
    nc = d // (t.bk * t.kc)
    ins = _operands(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, w_down_scale, w_up_scale)
    split = [jax.ShapeDtypeStruct((s * nc * m * (r + s),), F32), jax.ShapeDtypeStruct((s * nc * m,), F32)]
    gates = [jax.ShapeDtypeStruct((m * r,), F32), jax.ShapeDtypeStruct((s * mp,), F32)]     # u, rstd
    xh = [jax.ShapeDtypeStruct((m * d,), dt)] + ([jax.ShapeDtypeStruct((m * sd,), dt)] if has_y else [])
    injo = [jax.ShapeDtypeStruct((m * s,), dt)] if has_inj else []
    body = functools.partial(
        _few_one_kernel, m=m, mp=mp, s=s, d=d, r=r, bn=t.bn, bk=t.bk, kc=t.kc, bm=t.bm, bd=t.bd, eps=eps,
        has_y=has_y, has_inj=has_inj, fp8=fp8, up_pieces=tuple(kernel._pieces(-(-r // 16) * 16, 128)),
        n_blocks=n_blocks, programs=programs, max_polls=t.max_polls, interpret=interpret, sync_index=sync_index)
    name = "hc_boundary_few1" + ("_fp8" if fp8 else "")
    call = _phase_caller(body, name, "phase", "all", programs=programs, interpret=interpret, num_warps=t.num_warps,
                         num_stages=t.num_stages)
    if launches == 1:
        res = call("all", ins + (_counter(sync, sync_index, interpret, name),), xh + injo + split + gates)
        res, res_inj = res[:len(xh)], res[len(xh):]
    else:
        sp = call("down", ins, split)
        res_inj = call("mid", ins + tuple(sp), injo + gates)
        res = call("up", ins + tuple(res_inj[len(injo):]), xh)
    x = res[0].reshape(*lead, d)
    h_new = res[1].reshape(h.shape) if has_y else h
    inj = res_inj[0].reshape(*lead, s) if has_inj else None
    return h_new, x, inj
