"""`fnx.generate`: the engine driven to completion (or streamed), and a jitted `lax.while_loop` generator for
research code (no host round trip per token)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from fnx.engine.engine import Engine, Output, SpeculativeConfig
from fnx.engine.sampling import SamplingArrays, SamplingParams, row_keys, sample
from fnx.model.api import Model
from fnx.model.ngram_device import NgramDeviceTables, ngram_ids_device
from fnx.model.transformer import init_state, step
from fnx.ple import ngram_ids


def _as_prompts(prompts) -> list[list[int]]:
    if len(prompts) and np.isscalar(prompts[0]):
        prompts = [prompts]
    return [list(map(int, p)) for p in prompts]


def generate(model: Model, prompts, max_new_tokens: int = 32, sampling: SamplingParams | None = None,
             speculative: SpeculativeConfig | int | None = None, stream: bool = False, max_slots: int | None = None,
             prefill_chunk: int = 8192, engine: Engine | None = None):
    """Generate for one prompt (a list of ids) or many. Returns the generated ids per prompt (stop token
    included when generation stopped on one), or with `stream=True` an iterator of `Output` events."""
    prompts = _as_prompts(prompts)
    sampling = replace(sampling or SamplingParams(), max_tokens=max_new_tokens)
    if engine is None:
        k = speculative.k if isinstance(speculative, SpeculativeConfig) else (speculative or 0)
        capacity = max(len(p) for p in prompts) + max_new_tokens + k + 1
        engine = Engine(model, max_slots=max_slots or min(len(prompts), 8), capacity=max(capacity, 8),
                        prefill_chunk=prefill_chunk, speculative=speculative)
    ids = [engine.submit(p, sampling) for p in prompts]
    events = _drive(engine)
    if stream:
        return events
    out = {i: [] for i in ids}
    for ev in events:
        out[ev.request_id].extend(ev.token_ids)
    return [out[i] for i in ids]


def _drive(engine: Engine) -> Iterator[Output]:
    while engine.has_work():
        for ev in engine.step():
            if ev.token_ids or ev.finished:
                yield ev


# ---- the jitted loop ---------------------------------------------------------------------------------------------

def generate_jit(model: Model, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None,
                 seed: int = 0):
    """Batched generation as one jitted program: prefill [B, P] (equal-length prompts), then a `lax.while_loop`
    of decode steps until every row has stopped or `max_new_tokens` are out. PLE n-gram ids are computed in the
    loop from the token history with 32-bit arithmetic (exact, see `fnx.model.ngram_device`). Returns (tokens
    [B, max_new_tokens] with -1 after a row stops, lengths [B])."""
    prompt = np.asarray(prompt_ids, np.int32)
    if prompt.ndim == 1:
        prompt = prompt[None]
    sampling = sampling or SamplingParams()
    if sampling.uses_penalties:
        raise ValueError("generate_jit does not apply repetition/presence/frequency penalties; use generate()")
    bsz, plen = prompt.shape
    cfg = model.cfg
    ple_ids = None
    tables = None
    if model.ngram is not None:
        ctx = np.full((bsz, model.ngram.ngram_size - 1), model.ngram.eos_token_id, np.int64)
        ple_ids = jnp.asarray(ngram_ids(ctx, prompt.astype(np.int64), model.ngram)[0].astype(np.int32))
        tables = NgramDeviceTables.build(model.ngram)
    eos = cfg.eos_token_id
    stops = sorted(set((eos if isinstance(eos, tuple) else (eos,)) if eos is not None else ())
                   | set(sampling.stop_token_ids)) if not sampling.ignore_eos else sorted(set(sampling.stop_token_ids))
    state = init_state(cfg, bsz, plen + max_new_tokens, model.dtype)
    sp = SamplingArrays.stack([sampling] * bsz)
    return _generate_loop(model.params, state, jnp.asarray(prompt), ple_ids, sp, jnp.asarray(seed, jnp.uint32),
                          jnp.asarray(stops or [-1], jnp.int32), tables, cfg=cfg, max_new=max_new_tokens)


@partial(jax.jit, static_argnames=("cfg", "max_new"), donate_argnames=("state",))
def _generate_loop(params, state, prompt, ple_ids, sp, seed, stops, tables, *, cfg, max_new):
    bsz = prompt.shape[0]
    logits, state, _, _ = step(params, state, prompt, ple_ids, cfg=cfg)
    seeds = jnp.full((bsz,), seed, jnp.uint32) + jnp.arange(bsz, dtype=jnp.uint32)
    tok, _ = sample(logits[:, -1], sp, row_keys(seeds, jnp.zeros((bsz,), jnp.uint32)))
    out = jnp.full((bsz, max_new), -1, jnp.int32).at[:, 0].set(tok)
    done = jnp.isin(tok, stops)

    def cond(c):
        i, _, _, _, done = c
        return (i < max_new) & ~jnp.all(done)

    def body(c):
        i, state, tok, out, done = c
        ids = None
        if tables is not None:
            ids = ngram_ids_device(state["ngram_ctx"], tok[:, None], tables)
        logits, state, _, _ = step(params, state, tok[:, None], ids, cfg=cfg,
                                   n_valid=jnp.where(done, 0, 1).astype(jnp.int32))
        nxt, _ = sample(logits[:, 0], sp, row_keys(seeds, jnp.full((bsz,), i, jnp.uint32)))
        nxt = jnp.where(done, -1, nxt)
        out = out.at[:, i].set(nxt)
        done = done | jnp.isin(nxt, stops)
        return i + 1, state, jnp.maximum(nxt, 0), out, done

    _, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.asarray(1), state, tok, out, done))
    lengths = jnp.sum(out >= 0, axis=1)
    return out, lengths
