"""The Flash-Next text model as pure functions: `step(params, state, tokens, ple_ids) -> (logits, state, hidden)`.

Layers are grouped by the period of `layer_types` (4 for the release: GDN, GDN, GDN, QSA). Runs of at least two
identical groups without a PLE layer are stacked and run under `lax.scan`; the rest (the group holding the PLE
layer, a ragged tail) run unrolled. Params and state follow the same plan, so both are pytrees of segments.

Glossary: B batch, L new tokens, T cache capacity, D hidden, S hc streams, E experts, K top-k, V vocab."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import jax
import jax.numpy as jnp
from jax import lax

from fnx.config import LINEAR, ModelConfig
from fnx.model import gdn, hyper, moe, ple, qsa
from fnx.model.ops import apply_rope, linear, rope_tables
from fnx.pallas import dispatch, grid_sync


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int      # first layer
    period: int     # layers per group
    reps: int       # groups; scanned when > 1
    scanned: bool

    @property
    def layers(self) -> range:
        return range(self.start, self.start + self.period * self.reps)


@lru_cache(maxsize=None)
def layer_plan(cfg: ModelConfig) -> tuple[Segment, ...]:
    types, n = cfg.layer_types, cfg.num_hidden_layers
    if not cfg.scan_layers:
        return tuple(Segment(i, 1, 1, False) for i in range(n))
    period = next(p for p in range(1, n + 1) if all(types[i] == types[i % p] for i in range(n)))
    special = set(cfg.ple_layers)
    groups = [(g * period, min(period, n - g * period)) for g in range(-(-n // period))]
    plan: list[Segment] = []
    run: list[int] = []

    def flush():
        if len(run) >= 2:
            plan.append(Segment(run[0], period, len(run), True))
        else:
            plan.extend(Segment(i, 1, 1, False) for s in run for i in range(s, s + period))
        run.clear()

    for start, size in groups:
        if size == period and not special.intersection(range(start, start + size)):
            run.append(start)
            continue
        flush()
        plan.extend(Segment(i, 1, 1, False) for i in range(start, start + size))
    flush()
    return tuple(plan)


def state_plan(cfg: ModelConfig) -> tuple[Segment, ...]:
    """The plan the decode state follows: the params' (`layer_plan`), except with `cfg.unroll_stacked`, where the
    params keep their stacked groups but every layer has its own state (the unrolled plan)."""
    return layer_plan(cfg.replace(scan_layers=False) if cfg.unroll_stacked else cfg)


# ---- parameter and state shapes ------------------------------------------------------------------------------

def _hc_shapes(cfg, inject=True):
    sd = cfg.hc_dim
    out = {"hc_norm": (sd,), "input_mix_weight_down": (cfg.hc_lowrank, sd), "input_mix_weight_up": (sd, cfg.hc_lowrank)}
    if inject:
        out["block_inject_weight"] = (cfg.hc_count, sd)
    return out


def layer_param_shapes(cfg: ModelConfig, i: int) -> dict:
    d = cfg.hidden_size
    layer = {"attn_hyper_connection": _hc_shapes(cfg), "mlp_hyper_connection": _hc_shapes(cfg)}
    if cfg.layer_types[i] == LINEAR:
        layer["linear_attn"] = {
            "in_proj_qkv": (cfg.conv_dim, d), "in_proj_z": (cfg.value_dim, d),
            "in_proj_b": (cfg.linear_num_value_heads, d), "in_proj_a": (cfg.linear_num_value_heads, d),
            "conv1d": (cfg.conv_dim, cfg.linear_conv_kernel_dim), "dt_bias": (cfg.linear_num_value_heads,),
            "A_log": (cfg.linear_num_value_heads,), "norm": (cfg.linear_value_head_dim,),
            "out_proj": (d, cfg.value_dim),
        }
    else:
        h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        di = cfg.indexer_head_dim
        layer["self_attn"] = {
            "q_proj": (2 * h * hd, d), "k_proj": (hkv * hd, d), "v_proj": (hkv * hd, d), "o_proj": (d, h * hd),
            "q_norm": (hd,), "k_norm": (hd,),
            "indexer": {"index_qk_proj": ((cfg.indexer_n_heads + 1) * di, d), "q_layernorm": (di,),
                        "k_layernorm": (di,)},
        }
    e, inter, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    layer["mlp"] = {
        "gate": (e, d),
        "experts": {"gate_up_proj": (e, 2 * inter, d), "down_proj": (e, d, inter)},
        "shared_expert": {"gate_proj": (si, d), "up_proj": (si, d), "down_proj": (d, si)},
        "shared_expert_gate": (1, d),
    }
    if i in cfg.ple_layers:
        from fnx.ple import NgramConstants
        rows = NgramConstants.from_config(cfg, cfg.ple_layers.index(i)).num_rows
        sd, pe = cfg.hc_dim, cfg.ple_embed_dim
        layer["ple"] = {
            "key_proj": (sd, pe), "value_proj": (d, pe), "norm_key": (sd,), "norm_query": (sd,),
            "norm_conv": (sd,), "conv1d": (sd, cfg.ple_conv_kernel_size),
            "ple_embedding": {"ngram_embedding": (rows, pe // cfg.ngram_heads)},
        }
    return layer


def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(v, int) for v in x)


def param_shapes(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """The params pytree as jax.ShapeDtypeStruct leaves, arranged by `layer_plan`."""
    to_sds = lambda tree, lead=(): jax.tree.map(lambda s: jax.ShapeDtypeStruct(lead + s, dtype), tree,
                                                is_leaf=_is_shape)
    segments = []
    for seg in layer_plan(cfg):
        segments.append(tuple(to_sds(layer_param_shapes(cfg, seg.start + j), (seg.reps,) if seg.scanned else ())
                              for j in range(seg.period)))
    return {
        "embed_tokens": to_sds((cfg.vocab_size, cfg.hidden_size)),
        "lm_head": to_sds((cfg.vocab_size, cfg.hidden_size)),
        "hyper_connection_mixer": to_sds(_hc_shapes(cfg, inject=False)),
        "segments": segments,
    }


def arrange_layers(cfg: ModelConfig, layers: list[dict]) -> list:
    """Per-layer param dicts (index = layer) -> the `segments` list of the params pytree (stacking scanned runs)."""
    out = []
    for seg in layer_plan(cfg):
        if seg.scanned:
            out.append(tuple(
                jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[seg.start + g * seg.period + j]
                                                          for g in range(seg.reps)])
                for j in range(seg.period)))
        else:
            out.append((layers[seg.start],))
    return out


def _layer_state(cfg: ModelConfig, i: int, batch: int, capacity: int, dtype):
    if cfg.layer_types[i] == LINEAR:
        st = {"conv": jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
              "rec": jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                cfg.linear_value_head_dim), jnp.float32)}
    else:
        cr, di = cfg.indexer_compress_ratio, cfg.indexer_head_dim
        kv = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        st = {"k": jnp.zeros(kv, dtype), "v": jnp.zeros(kv, dtype),
              "idx_blocks": jnp.zeros((batch, capacity // cr, di), dtype),
              "idx_ring": jnp.zeros((batch, cr, di), dtype)}
    if i in cfg.ple_layers:
        st["ple_conv"] = jnp.zeros((batch, cfg.ple_conv_state_len, cfg.hc_dim), dtype)
    return st


def init_state(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> dict:
    """Empty decode state for `batch` sequences of up to `capacity` tokens (MODEL_SPEC.md section 9)."""
    segments = []
    for seg in state_plan(cfg):
        per = []
        for j in range(seg.period):
            st = _layer_state(cfg, seg.start + j, batch, capacity, dtype)
            if seg.scanned:
                st = jax.tree.map(lambda a: jnp.broadcast_to(a, (seg.reps,) + a.shape), st)
            per.append(st)
        segments.append(tuple(per))
    eos = cfg.ple_eos_token_id if cfg.ple_layer_ids else 0
    return {
        "pos": jnp.zeros((batch,), jnp.int32),
        "ngram_ctx": jnp.full((batch, max(cfg.ngram_size - 1, 1)), eos, jnp.int32),
        "segments": segments,
    }


# ---- forward -------------------------------------------------------------------------------------------------

def decoder_layer(cfg: ModelConfig, kind: str, has_ple: bool, p: dict, st: dict, h: jax.Array, meta: dict,
                  moe_impl: str, snapshots: bool = False, pending=None, defer: bool = False):
    """One decoder layer on the multi-stream hidden h [B, L, S*D].
    Returns (h, new layer state, aux for rollback, router expert ids [B, L, K]).

    pending: (y, inj) of the previous layer's MLP not yet combined into h: the combine then runs inside this
    layer's first hyper-connection boundary (one fused kernel at decode sizes instead of two launches).
    defer: return (h, y, inj) in place of h, leaving this layer's last combine to the next boundary."""
    eps, s = cfg.rms_norm_eps, cfg.hc_count
    n_valid = meta["n_valid"]
    st, aux = dict(st), {}
    # named scopes (no effect on the arithmetic) put the family into every op's name, so a profile's kernels can be
    # attributed: fnx.pallas.ledger
    if has_ple:
        with jax.named_scope("ple"):
            if pending is not None:   # the PLE layer reads the combined hidden: no fusion across it
                h, pending = hyper.combine(h, *pending), None
            rows = meta["ple_rows"]
            if rows is None:  # the table lives in the params (on the device), or its handle does
                table = p["ple"]["ple_embedding"]["ngram_embedding"]
                if meta.get("ple_ticket") is not None:    # a ring's rows, asked for at the step's start
                    rows = table.wait(meta["ple_ticket"], h)
                else:
                    rows = ple.gather_rows(table, meta["ple_ids"])
            out, st["ple_conv"], aux["ple_conv_x"] = ple.ple_layer(p["ple"], h, rows, st["ple_conv"], cfg, n_valid)
            h = h + out
    with jax.named_scope("hc"):
        if pending is None:
            x, inj = hyper.gated_residual(p["attn_hyper_connection"], h, s, eps)
        else:                         # the previous layer's combine and this gated residual: one boundary
            h, x, inj = hyper.boundary(p["attn_hyper_connection"], h, pending[0], pending[1], s, eps)
    if kind == LINEAR:
        with jax.named_scope("gdn"):
            y, st["conv"], st["rec"], a = gdn.gdn_layer(p["linear_attn"], x, st["conv"], st["rec"], cfg, n_valid,
                                                        snapshots)
    else:
        with jax.named_scope("qsa"):
            y, new, a = qsa.qsa_layer(p["self_attn"], x, st, meta["pos0"], meta["cos"], meta["sin"],
                                      meta["rope_fn"], cfg, n_valid)
        st.update(new)
    aux.update(a)
    # the mixer's combine and the MLP's gated residual: one boundary (a single fused kernel at decode sizes)
    with jax.named_scope("hc"):
        h, x, inj = hyper.boundary(p["mlp_hyper_connection"], h, y, inj, s, eps)
    with jax.named_scope("moe"):
        y, _, ids = moe.moe_block(p["mlp"], x, cfg.num_experts_per_tok, cfg.norm_topk_prob, moe_impl)
    if defer:
        return (h, y, inj), st, (aux if snapshots else {}), ids
    with jax.named_scope("hc"):
        h = hyper.combine(h, y, inj)
    return h, st, (aux if snapshots else {}), ids


def make_meta(cfg: ModelConfig, pos0: jax.Array, length: int, dtype, n_valid=None, ple_ids=None, ple_rows=None,
              gdn: bool = True):
    """Per-call metadata shared by every layer. pos0 [B] first position; n_valid [B] real tokens (default L).
    gdn: the program runs GDN layers (the MTP layer's does not: no counters for the GDN step's knob).
    counters: the counter pool in scope where the caller made one for its whole program (the MTP drafter's chained
    steps share one), else this call's own (`counter_pool`)."""
    positions = pos0[:, None] + jnp.arange(length, dtype=jnp.int32)
    cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta, dtype)

    def rope_fn(x, pos):  # x [B, N, heads, hd], pos [B, N]
        c, s_ = rope_tables(pos, cfg.rotary_dim, cfg.rope_theta, dtype)
        return apply_rope(x, c, s_)

    if n_valid is None:
        n_valid = jnp.full(pos0.shape, length, jnp.int32)
    return {"pos0": pos0, "cos": cos, "sin": sin, "rope_fn": rope_fn, "ple_ids": ple_ids, "ple_rows": ple_rows,
            "n_valid": n_valid.astype(jnp.int32),
            "counters": grid_sync.current_pool() or counter_pool(pos0.shape[0] * length, length if gdn else None)}


def counter_pool(tokens: int, length: int | None = None):
    """The program's pool of counters (`fnx.pallas.grid_sync.CounterPool`, made once per program; in scope while its
    layers and head are traced) where a kernel counts its programs: split-K GEMVs that sum in place
    (`FNX_GEMV_FINISH=1`), the MoE decode's combine (`FNX_MOE_FINISH=1`), the one-launch HC boundaries' barriers
    (ops "hc_boundary_one" / "hc_boundary_few_one" named), the GDN step's in-place conv window
    (`fnx.pallas.gdn.pallas.conv_in_place`: the default where gdn_step runs its compiled kernel; one-token calls:
    `length` 1), the QSA indexer's one-launch token choice (op "qsa_select" on its compiled kernel); at decode
    sizes (`fnx.pallas.gemv.api.MAX_M` tokens at most). Else None."""
    from fnx.pallas import dispatch
    from fnx.pallas.gemv import api as gemv_api
    from fnx.pallas.hc import api as hc_api
    from fnx.pallas.moe import api as moe_api
    from fnx.pallas.gdn import pallas as gdn_kernel
    from fnx.pallas.qsa import api as qsa_api
    on = (grid_sync.knob(gemv_api.FINISH_ENV) or grid_sync.knob(moe_api.FINISH_ENV) or hc_api.one_launch(tokens)
          or (length == 1 and gdn_kernel.conv_in_place()) or dispatch.resolve(qsa_api.SELECT_OP) == "pallas")
    if not on or tokens > gemv_api.MAX_M:
        return None
    interpret = dispatch.why_unavailable("pallas") is not None
    return grid_sync.CounterPool(grid_sync.counter(interpret, grid_sync.POOL_SIZE))


def ple_split_point(cfg: ModelConfig) -> int | None:
    """How many leading segments of `layer_plan(cfg)` run before the first PLE layer (None without PLE): the
    point where `step_front` hands over to `step_back`, so that a host store's rows can be fetched while the
    device runs the embedding and the layers before the PLE layer."""
    if not cfg.ple_layers:
        return None
    first = min(cfg.ple_layers)
    return next(i for i, seg in enumerate(layer_plan(cfg)) if first in seg.layers)


def front_inputs(cfg: ModelConfig, params: dict, state: dict) -> tuple[dict, dict]:
    """The parts of params and state `step_front` reads (the embedding and the segments before the PLE layer), so
    the first program's call hands over a few arrays, not every layer's."""
    split = ple_split_point(cfg)
    if split is None:
        raise ValueError("this config has no PLE layer to split the step at")
    # the state's segments follow `state_plan`: one per layer with `unroll_stacked`, where the params' are groups
    state_split = layer_plan(cfg)[split].start if cfg.unroll_stacked else split
    return ({"embed_tokens": params["embed_tokens"], "segments": params["segments"][:split]},
            {"pos": state["pos"], "ngram_ctx": state["ngram_ctx"], "segments": state["segments"][:state_split]})


def _check_ple(cfg, ple_ids, ple_rows):
    if cfg.ple_layer_ids and ple_ids is None and ple_rows is None:
        raise ValueError("this config has a PLE layer: pass ple_ids (from fnx.ple.ngram_ids) or ple_rows")


def step(params: dict, state: dict, tokens: jax.Array, ple_ids: jax.Array | None, *, cfg: ModelConfig,
         moe_impl: str = "auto", ple_rows: jax.Array | None = None, n_valid: jax.Array | None = None,
         snapshots: bool = False, collect: bool = False, logits_at: jax.Array | None = None):
    """Run L new tokens per sequence on an existing state (prefill, chunked prefill, decode, verify alike).

    tokens [B, L] int32; ple_ids [B, L, ngram heads] int32 from `fnx.ple.ngram_ids` (None without PLE);
    ple_rows [B, L, ple_embed_dim]: the table rows already fetched (a host-side store), used instead of the
    params' table when given; n_valid [B]: how many of the L tokens are real for each row (the rest is padding
    and leaves the state as it was; 0 leaves a row untouched); snapshots: keep what `rollback` needs to stop the
    state after any prefix of the call (speculative verify).
    collect: also return every layer's output hidden [layers, B, L, S*D] (all hyper-connection streams) and its
    routed expert ids [layers, B, L, K] in aux["hidden"] / aux["experts"].
    logits_at [B] int32: the logits of that position of each row only (a prefill chunk needs its last valid row's),
    [B, 1, V]: the head skips the other rows (at a 2,048-token chunk of the released model a 2.6 TFLOP product
    and 2 GB of fp32 logits).
    Returns logits [B, L, V], the new state, the pre-mixer hidden [B, L, S*D] (what the MTP layer reads) and aux
    (the rollback material with snapshots, the per-layer outputs with collect; else empty).

    The same computation as `step_back(..., step_front(...))`, which splits it at the PLE layer."""
    _check_ple(cfg, ple_ids, ple_rows)
    nseg = len(layer_plan(cfg))
    front = _run(params, state, tokens, cfg, moe_impl, n_valid, snapshots, collect, 0, nseg, ple_ids, ple_rows,
                 None)
    return _finish(params, state, tokens, front, cfg, snapshots, collect, logits_at)


def step_front(params: dict, state: dict, tokens: jax.Array, *, cfg: ModelConfig, moe_impl: str = "auto",
               n_valid: jax.Array | None = None, snapshots: bool = False) -> dict:
    """The first half of `step`, split at the PLE layer: the embedding and every segment before the one holding
    the first PLE layer (`ple_split_point`). Needs no PLE input, so it can run while a host store's rows are
    fetched. Returns the hand-over pytree `step_back` takes (the pending hidden, the new states and rollback
    material of the segments run). The state itself is not changed. params and state may be cut to what this half
    reads (`front_inputs`)."""
    split = ple_split_point(cfg)
    if split is None:
        raise ValueError("step_front splits the step at the PLE layer; this config has none (use step)")
    out = _run(params, state, tokens, cfg, moe_impl, n_valid, snapshots, False, 0, split, None, None, None)
    return {k: v for k, v in out.items() if k not in ("meta", "layers")}   # meta holds a function: not an output


def step_back(params: dict, state: dict, tokens: jax.Array, front: dict, ple_ids: jax.Array | None = None, *,
              cfg: ModelConfig, moe_impl: str = "auto", ple_rows: jax.Array | None = None,
              n_valid: jax.Array | None = None, snapshots: bool = False, logits_at: jax.Array | None = None):
    """The second half of `step`: the segments from the PLE layer on, the head, and the new state, continuing
    `front` (from `step_front` on the same state, tokens, n_valid and snapshots). Returns what `step` returns."""
    _check_ple(cfg, ple_ids, ple_rows)
    split = ple_split_point(cfg)
    out = _run(params, state, tokens, cfg, moe_impl, n_valid, snapshots, False, split, len(layer_plan(cfg)),
               ple_ids, ple_rows, front)
    return _finish(params, state, tokens, out, cfg, snapshots, False, logits_at)


def _run(params, state, tokens, cfg, moe_impl, n_valid, snapshots, collect, lo, hi, ple_ids, ple_rows, front):
    """Segments [lo, hi) of the layer plan, continuing `front` (None: from the embedding)."""
    meta = make_meta(cfg, state["pos"], tokens.shape[1], params["embed_tokens"].dtype, n_valid, ple_ids, ple_rows)
    from fnx.pallas import grid_sync
    with grid_sync.counter_pool(meta["counters"]):      # the program's counters (`counter_pool`), or None
        return _run_segments(params, state, tokens, cfg, moe_impl, snapshots, collect, lo, hi, ple_ids, ple_rows,
                             front, meta)


def _run_segments(params, state, tokens, cfg, moe_impl, snapshots, collect, lo, hi, ple_ids, ple_rows, front, meta):
    """`_run` with its per-call metadata made."""
    if front is None:
        table = _ple_table(params, cfg) if ple_ids is not None and ple_rows is None else None
        if hasattr(table, "post"):   # a ring (fnx.ple.ring): the host fetches the rows while the first layers run
            meta["ple_ticket"] = table.post(ple_ids)
            tokens, _ = lax.optimization_barrier((tokens, meta["ple_ticket"].seq))   # the post goes first
        e = params["embed_tokens"][tokens]
        h = jnp.tile(e, (1, 1, cfg.hc_count))
        # every layer leaves its last combine pending (carry = (h, y, inj)); the next layer's first boundary does
        # it. Before layer 0 nothing is pending (y None), unless a scanned segment comes first: a scan's carry
        # needs arrays, and y = 0, inj = 0 combine to h exactly (h + 0).
        front = {"carry": (h, None, None), "segments": [], "aux": [],
                 "layers": [None] * cfg.num_hidden_layers if collect else None}
    carry = front["carry"]
    new_segments, aux_segments = list(front["segments"]), list(front["aux"])
    per_layer = front.get("layers")                                  # (hidden, expert ids) when collecting
    plan = layer_plan(cfg)
    if cfg.unroll_stacked:
        return _run_stacked(cfg, plan[lo:hi], params["segments"][lo:hi], state, carry, meta, moe_impl, snapshots,
                            new_segments, aux_segments, per_layer)
    for seg, seg_params, seg_state in zip(plan[lo:hi], params["segments"][lo:hi], state["segments"][lo:hi]):
        kinds = [cfg.layer_types[seg.start + j] for j in range(seg.period)]
        if not seg.scanned:
            carry = _unrolled_layer(cfg, seg.start, seg_params[0], seg_state[0], carry, meta, moe_impl, snapshots,
                                    new_segments, aux_segments, per_layer)
            continue

        def body(carry, xs, kinds=kinds):
            ps, sts = xs
            outs, auxes, seen = [], [], []
            with dispatch.in_scanned_layers():
                for kind, p, st in zip(kinds, ps, sts):
                    carry, st, aux, ids = decoder_layer(cfg, kind, False, p, st, carry[0], meta, moe_impl,
                                                        snapshots, carry[1:], True)
                    outs.append(st)
                    auxes.append(aux)
                    seen.append((hyper.combine(*carry), ids) if collect else ())
            return carry, (tuple(outs), tuple(auxes), tuple(seen))

        if carry[1] is None:
            carry = (carry[0], jnp.zeros(carry[0].shape[:-1] + (cfg.hidden_size,), carry[0].dtype),
                     jnp.zeros(carry[0].shape[:-1] + (cfg.hc_count,), carry[0].dtype))
        carry, (st, aux, seen) = lax.scan(body, carry, (seg_params, seg_state))
        new_segments.append(st)
        aux_segments.append(aux)
        if collect:
            for g in range(seg.reps):
                for j in range(seg.period):
                    per_layer[seg.start + g * seg.period + j] = jax.tree.map(lambda a: a[g], seen[j])
    return {"carry": carry, "segments": new_segments, "aux": aux_segments, "layers": per_layer, "meta": meta}


def _ple_table(params, cfg):
    """The PLE layer's n-gram table leaf (an array or a store's handle), or None (no PLE, or in a scanned group)."""
    if not cfg.ple_layers:
        return None
    layer = cfg.ple_layers[0]
    for seg, seg_params in zip(layer_plan(cfg), params["segments"]):
        if seg.start <= layer < seg.start + seg.reps * seg.period:
            return None if seg.scanned else seg_params[0].get("ple", {}).get("ple_embedding", {}).get("ngram_embedding")
    return None


def _run_stacked(cfg, plan, params_segments, state, carry, meta, moe_impl, snapshots, new_segments, aux_segments,
                 per_layer):
    """`cfg.unroll_stacked`: the layers of the plan segments given, in order, unrolled. A stacked group's layer g
    reads its params as `LayerRef(stack, g)` views (kernels index the stack in place; XLA ops take the slice); the
    state is per layer (`state_plan`), so its segments are indexed by layer. Appends to new_segments /
    aux_segments (the front's, when continuing one) and fills per_layer when collecting; returns what `_run`
    returns, in the per-layer plan."""
    from fnx.pallas.stacked import LayerRef
    layer_states = state["segments"]             # one (state,) per layer: the unrolled plan
    for seg, seg_params in zip(plan, params_segments):
        for g in range(seg.reps):
            for j in range(seg.period):
                i = seg.start + g * seg.period + j
                p = seg_params[j]
                if seg.scanned:
                    p = jax.tree.map(lambda a, g=g: LayerRef(a, g), p)
                carry = _unrolled_layer(cfg, i, p, layer_states[i][0], carry, meta, moe_impl, snapshots,
                                        new_segments, aux_segments, per_layer)
    return {"carry": carry, "segments": new_segments, "aux": aux_segments, "layers": per_layer, "meta": meta}


def _unrolled_layer(cfg, i, p, st, carry, meta, moe_impl, snapshots, new_segments, aux_segments, per_layer):
    """Layer i outside any scan (params p, state st): appends its new state and rollback material, records its
    output when collecting (per_layer not None), returns the new carry."""
    carry, st, aux, ids = decoder_layer(cfg, cfg.layer_types[i], i in cfg.ple_layers, p, st, carry[0], meta,
                                        moe_impl, snapshots, None if carry[1] is None else carry[1:], True)
    new_segments.append((st,))
    aux_segments.append((aux,))
    if per_layer is not None:
        per_layer[i] = (hyper.combine(*carry), ids)
    return carry


def _finish(params, state, tokens, out, cfg, snapshots, collect, logits_at=None):
    carry, meta = out["carry"], out["meta"]
    pos0 = state["pos"]
    from fnx.pallas import grid_sync
    # the last layer's combine and the final mixer: one boundary (the program's counters in scope, as the layers')
    with jax.named_scope("head"), grid_sync.counter_pool(meta["counters"]):
        h, x, _ = hyper.boundary(params["hyper_connection_mixer"], carry[0], carry[1], carry[2], cfg.hc_count,
                                 cfg.rms_norm_eps, inject=False)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)
        logits = linear(x, params["lm_head"])
    ctx_x = jnp.concatenate([state["ngram_ctx"], tokens.astype(jnp.int32)], axis=1)
    width = state["ngram_ctx"].shape[1]
    new_state = {"pos": pos0 + meta["n_valid"], "ngram_ctx": gdn.window_after(ctx_x[..., None], meta["n_valid"],
                                                                              width)[..., 0],
                 "segments": out["segments"]}
    aux = {"segments": out["aux"], "pos0": pos0, "ngram_x": ctx_x} if snapshots else {}
    if collect:
        per_layer = out["layers"]
        aux["hidden"] = jnp.stack([hl for hl, _ in per_layer])
        aux["experts"] = jnp.stack([ids for _, ids in per_layer])
    return logits, new_state, h, aux


def rollback(cfg: ModelConfig, state: dict, aux: dict, n_keep: jax.Array) -> dict:
    """The state as if only the first n_keep [B] tokens of a `snapshots=True` call had been run (0 <= n_keep <= L).
    K/V and finished blocks past the kept length stay in place; they lie beyond the valid length and are
    overwritten before anything reads them."""
    n_keep = n_keep.astype(jnp.int32)
    pos0, cr = aux["pos0"], cfg.indexer_compress_ratio

    def fix(st, ax, scanned):
        st = dict(st)
        if "rec" in st:
            # the replay of the kept tokens, and the conv state after them (copied by the replay's kernel where
            # op "gdn_replay_conv" is on, else a gather of its own)
            rec_aux = {key: ax[key] for key in ("rec0", "k", "v", "g", "beta", "conv_x")}
            after = lambda a: gdn.rec_after(a, n_keep, st["conv"].shape[-2])  # noqa: E731
            st["rec"], st["conv"] = jax.vmap(after)(rec_aux) if scanned else after(rec_aux)
        if "idx_ring" in st:
            f = lambda buf: qsa.ring_after(buf, pos0, n_keep, cr)  # noqa: E731
            st["idx_ring"] = jax.vmap(f)(ax["idx_buf"]) if scanned else f(ax["idx_buf"])
        if "ple_conv" in st:
            st["ple_conv"] = gdn.window_after(ax["ple_conv_x"], n_keep, st["ple_conv"].shape[-2])
        return st

    segments = []
    for seg, seg_state, seg_aux in zip(state_plan(cfg), state["segments"], aux["segments"]):
        segments.append(tuple(fix(st, ax, seg.scanned) for st, ax in zip(seg_state, seg_aux)))
    width = state["ngram_ctx"].shape[1]
    ctx = gdn.window_after(aux["ngram_x"][..., None], n_keep, width)[..., 0]
    return {"pos": pos0 + n_keep, "ngram_ctx": ctx, "segments": segments}


def _batch_axis_tree(cfg: ModelConfig, state: dict):
    segs = [tuple(jax.tree.map(lambda _: 1 if seg.scanned else 0, st) for st in seg_state)
            for seg, seg_state in zip(state_plan(cfg), state["segments"])]
    return {"pos": 0, "ngram_ctx": 0, "segments": segs}


def slot_take(cfg: ModelConfig, state: dict, slot) -> dict:
    """The batch-1 state of one slot (slot may be traced)."""
    axes = _batch_axis_tree(cfg, state)
    return jax.tree.map(lambda a, ax: lax.dynamic_slice_in_dim(a, slot, 1, axis=ax), state, axes)


def slot_put(cfg: ModelConfig, state: dict, slot, sub: dict) -> dict:
    """Write a batch-1 state back into its slot."""
    axes = _batch_axis_tree(cfg, state)
    return jax.tree.map(lambda a, s_, ax: lax.dynamic_update_slice_in_dim(a, s_.astype(a.dtype), slot, axis=ax),
                        state, sub, axes)
