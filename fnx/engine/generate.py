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
    of decode steps until every row has stopped or `max_new_tokens` are out; the PLE n-gram ids are computed on
    the device with 32-bit arithmetic (exact, see `fnx.model.ngram_device`). Row b samples with seed + b.
    Returns (tokens [B, max_new_tokens] with -1 after a row stops, lengths [B]).

        toks, lengths = fnx.generate_jit(model, [[1, 2, 3], [4, 5, 6]], 16)
    """
    prompt = np.asarray(prompt_ids, np.int32)
    if prompt.ndim == 1:
        prompt = prompt[None]
    fn = generate_fn(model, max_new_tokens, sampling)
    seeds = jnp.asarray(seed, jnp.uint32) + jnp.arange(prompt.shape[0], dtype=jnp.uint32)
    return _jit_core(fn.params, jnp.asarray(prompt), seeds, SamplingArrays.stack([fn.sp] * prompt.shape[0]),
                     jnp.asarray(fn.stops), fn.tables, cfg=fn.cfg, max_new=fn.max_new)


class _GenerateFn:
    """A pure, jittable, vmappable generator: `fn(prompt [P], seed) -> (tokens [N], length)`."""

    def __init__(self, model: Model, max_new: int, sampling: SamplingParams):
        self.params, self.cfg, self.max_new = model.params, model.cfg, max_new
        self.sp = sampling
        self.tables = NgramDeviceTables.build(model.ngram) if model.ngram is not None else None
        eos = self.cfg.eos_token_id
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos and eos is not None:
            stops |= set(eos if isinstance(eos, tuple) else (eos,))
        self.stops = np.asarray(sorted(stops) or [-1], np.int32)

    def __call__(self, prompt, seed):
        toks, lengths = self.batched(prompt[None], jnp.asarray(seed, jnp.uint32)[None])
        return toks[0], lengths[0]

    def batched(self, prompt, seeds):
        return _generate_core(self.params, prompt, seeds, SamplingArrays.stack([self.sp] * prompt.shape[0]),
                              jnp.asarray(self.stops), self.tables, cfg=self.cfg, max_new=self.max_new)


def generate_fn(model: Model, max_new_tokens: int, sampling: SamplingParams | None = None) -> _GenerateFn:
    """The generator as a pure function of (prompt ids [P], seed) for research code: jit it, vmap it over prompts
    and seeds, or call it inside a larger program.

        gen = fnx.engine.generate_fn(model, 16, fnx.SamplingParams(temperature=1.0))
        toks, lengths = jax.jit(jax.vmap(gen))(prompts, jnp.arange(len(prompts)))   # prompts [N, P]
    """
    sampling = sampling or SamplingParams()
    if sampling.uses_penalties:
        raise ValueError("the jitted generator does not apply repetition/presence/frequency penalties; "
                         "use generate()")
    return _GenerateFn(model, max_new_tokens, sampling)


def _generate_core(params, prompt, seeds, sp, stops, tables, *, cfg, max_new):
    bsz, plen = prompt.shape
    state = init_state(cfg, bsz, plen + max_new, params["embed_tokens"].dtype)
    ids = ngram_ids_device(state["ngram_ctx"], prompt, tables) if tables is not None else None
    logits, state, _, _ = step(params, state, prompt, ids, cfg=cfg)
    tok, _ = sample(logits[:, -1], sp, row_keys(seeds, jnp.zeros((bsz,), jnp.uint32)))
    out = jnp.full((bsz, max_new), -1, jnp.int32).at[:, 0].set(tok)
    done = jnp.isin(tok, stops)

    def cond(c):
        i, _, _, _, done = c
        return (i < max_new) & ~jnp.all(done)

    def body(c):
        i, state, tok, out, done = c
        ids = ngram_ids_device(state["ngram_ctx"], tok[:, None], tables) if tables is not None else None
        logits, state, _, _ = step(params, state, tok[:, None], ids, cfg=cfg,
                                   n_valid=jnp.where(done, 0, 1).astype(jnp.int32))
        nxt, _ = sample(logits[:, 0], sp, row_keys(seeds, jnp.full((bsz,), i, jnp.uint32)))
        nxt = jnp.where(done, -1, nxt)
        out = out.at[:, i].set(nxt)
        done = done | jnp.isin(nxt, stops)
        return i + 1, state, jnp.maximum(nxt, 0), out, done

    _, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.asarray(1), state, tok, out, done))
    return out, jnp.sum(out >= 0, axis=1)


_jit_core = jax.jit(_generate_core, static_argnames=("cfg", "max_new"))
