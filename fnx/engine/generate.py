"""`fnx.generate`: the engine driven to completion (or streamed), and a jitted `lax.while_loop` generator for
research code (no host round trip per token)."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from fnx.engine.engine import Engine, Output, SpeculativeConfig, positions_reserved
from fnx.engine.sampling import SamplingArrays, SamplingParams, row_keys, sample
from fnx.model.api import PREFILL_CHUNK, Model
from fnx.model.ngram_device import NgramDeviceTables, ngram_ids_device
from fnx.model.transformer import init_state, step


def _as_prompts(model: Model, prompts) -> tuple[list[list[int]], bool, bool]:
    """-> (token id lists, given as text, given as a single prompt)."""
    if isinstance(prompts, str):
        return [_encode(model, prompts)], True, True
    if len(prompts) and isinstance(prompts[0], str):
        return [_encode(model, p) for p in prompts], True, False
    if len(prompts) and np.isscalar(prompts[0]):
        return [list(map(int, prompts))], False, True
    return [list(map(int, p)) for p in prompts], False, False


def _encode(model: Model, text: str) -> list[int]:
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer (no tokenizer.json beside its config): pass token ids")
    ids = model.tokenizer.encode(text)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return ids


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _engine_for(model, prompts, max_new_tokens, speculative, max_slots, prefill_chunk):
    """An engine sized for this call, its shapes rounded up (slots to 1, 2, 4 or 8, the context to a power of two
    of at least 256), so that a session's further calls reuse the compiled programs instead of compiling anew."""
    k = speculative.k if isinstance(speculative, SpeculativeConfig) else (speculative or 0)
    need = max(len(p) for p in prompts) + max_new_tokens + positions_reserved(k, overlap=True)
    return Engine(model, max_slots=max_slots or _pow2(min(len(prompts), 8)), capacity=max(_pow2(need), 256),
                  prefill_chunk=prefill_chunk, speculative=speculative, extra_eos=model.eos_token_ids)


def generate(model: Model, prompts, max_new_tokens: int = 32, sampling: SamplingParams | None = None,
             speculative: SpeculativeConfig | int | None = None, stream: bool = False, max_slots: int | None = None,
             prefill_chunk: int = 8192, engine: Engine | None = None, progress: bool = False):
    """Generate for a prompt or a list of prompts, each text (needs the model's tokenizer) or token ids.

    Returns what came in: text -> the generated text, ids -> the generated ids (the stop token included when
    generation stopped on one); a single prompt -> a single result. With `stream=True`: an iterator of `Output`
    events (request_id, token_ids, logprobs, finished, finish_reason); `progress=True` shows a tqdm bar.

        fnx.generate(model, "The Debian package manager", 40)              # -> str
        fnx.generate(model, [[1, 2, 3], [4, 5]], 8, speculative=4)         # -> [[...], [...]]
    """
    ids, as_text, single = _as_prompts(model, prompts)
    sampling = replace(sampling or SamplingParams(), max_tokens=max_new_tokens)
    own = engine is None
    engine = engine or _engine_for(model, ids, max_new_tokens, speculative, max_slots, prefill_chunk)
    rids = [engine.submit(p, sampling) for p in ids]
    events = _drive(engine, own)
    if stream:
        return events
    if progress:
        from tqdm.auto import tqdm
        events = _counted(events, tqdm(total=len(rids) * max_new_tokens, desc="generating", unit="tok"))
    out = {i: [] for i in rids}
    for ev in events:
        out[ev.request_id].extend(ev.token_ids)
    res = [out[i] for i in rids]
    if as_text:
        res = [model.tokenizer.decode(r) for r in res]
    return res[0] if single else res


def _counted(events, bar):
    for ev in events:
        bar.update(len(ev.token_ids))
        yield ev
    bar.close()


def stream_text(model: Model, prompt: str, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                speculative=None, echo: bool = True) -> Iterator[str]:
    """Yield the text as it is generated (never splitting a multi-byte character); with `echo`, also print it.

        for piece in fnx.stream_text(model, "Once upon a time", 64): pass      # prints as it goes
    """
    ids, _, _ = _as_prompts(model, prompt)
    detok = model.tokenizer.detokenizer()
    for ev in generate(model, ids, max_new_tokens, sampling, speculative, stream=True):
        piece = detok.add(ev.token_ids)
        if ev.finished:
            piece += detok.flush()
        if piece:
            if echo:
                print(piece, end="", flush=True)
            yield piece
    if echo:
        print()


def chat(model: Model, messages: list[dict], max_new_tokens: int = 256, sampling: SamplingParams | None = None,
         speculative=None, stream: bool = False, **template_kwargs):
    """Apply the checkpoint's chat template to `messages` ([{"role": ..., "content": ...}]) and generate the
    assistant's reply (text). With `stream=True`, prints as it goes and returns the full reply.

        fnx.chat(model, [{"role": "user", "content": "What is apt?"}])
    """
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer, so it has no chat template")
    prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
    ids = model.tokenizer.encode(prompt)
    if stream:
        return "".join(stream_text(model, ids, max_new_tokens, sampling, speculative))
    out = generate(model, ids, max_new_tokens, sampling, speculative)
    return model.tokenizer.decode(out)


def _drive(engine: Engine, own: bool = False) -> Iterator[Output]:
    """Step the engine until it is idle; an engine made for this call (own) is closed after."""
    try:
        while engine.has_work():
            for ev in engine.step():
                if ev.token_ids or ev.finished:
                    yield ev
    finally:
        if own:
            engine.close()


# ---- the jitted loop ---------------------------------------------------------------------------------------------

def generate_jit(model: Model, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None,
                 seed: int = 0, prefill_chunk: int | None = PREFILL_CHUNK):
    """Batched generation as one jitted program: prefill [B, P] (equal-length prompts), then a `lax.while_loop`
    of decode steps until every row has stopped or `max_new_tokens` are out; the PLE n-gram ids are computed on
    the device with 32-bit arithmetic (exact, see `fnx.model.ngram_device`). Row b samples with seed + b.
    Prompts longer than `prefill_chunk` tokens prefill in chunks of that many (a `lax.scan`, then the rest), as
    `fnx.extend` does; None prefills in one call. Returns (tokens [B, max_new_tokens] with -1 after a row
    stops, lengths [B]).

        toks, lengths = fnx.generate_jit(model, [[1, 2, 3], [4, 5, 6]], 16)
    """
    prompt = np.asarray(prompt_ids, np.int32)
    if prompt.ndim == 1:
        prompt = prompt[None]
    fn = generate_fn(model, max_new_tokens, sampling, prefill_chunk)
    seeds = jnp.asarray(seed, jnp.uint32) + jnp.arange(prompt.shape[0], dtype=jnp.uint32)
    return _jit_core(fn.params, jnp.asarray(prompt), seeds, SamplingArrays.stack([fn.sp] * prompt.shape[0]),
                     jnp.asarray(fn.stops), fn.tables, cfg=fn.cfg, max_new=fn.max_new, chunk=fn.chunk,
                     penalties=fn.sp.uses_penalties)


class _GenerateFn:
    """A pure, jittable, vmappable generator: `fn(prompt [P], seed) -> (tokens [N], length)`."""

    def __init__(self, model: Model, max_new: int, sampling: SamplingParams, chunk: int | None = PREFILL_CHUNK):
        from fnx.model.api import require_device_table
        require_device_table(model, "the jitted generate")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive number of tokens or None, got {chunk!r}")
        self.params, self.cfg, self.max_new, self.chunk = model.params, model.cfg, max_new, chunk
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
                              jnp.asarray(self.stops), self.tables, cfg=self.cfg, max_new=self.max_new,
                              chunk=self.chunk, penalties=self.sp.uses_penalties)


def generate_fn(model: Model, max_new_tokens: int, sampling: SamplingParams | None = None,
                prefill_chunk: int | None = PREFILL_CHUNK) -> _GenerateFn:
    """The generator as a pure function of (prompt ids [P], seed) for research code: jit it, vmap it over prompts
    and seeds, or call it inside a larger program.

        gen = fnx.engine.generate_fn(model, 16, fnx.SamplingParams(temperature=1.0))
        toks, lengths = jax.jit(jax.vmap(gen))(prompts, jnp.arange(len(prompts)))   # prompts [N, P]
    """
    return _GenerateFn(model, max_new_tokens, sampling or SamplingParams(), prefill_chunk)


def _prefill(params, state, prompt, tables, cfg, chunk):
    """The prompt [B, P] through the model: the chunks before the last token's chunk under a `lax.scan` (one trace
    of the step), then the rest (1..chunk tokens, the last one's logits) -> (logits [B, 1, V], state)."""
    bsz, plen = prompt.shape
    n_scan = 0 if chunk is None else (plen - 1) // chunk

    def run(st, toks, last=False):
        ids = ngram_ids_device(st["ngram_ctx"], toks, tables) if tables is not None else None
        # the last chunk: the head on its last token only, as the engine's prefill (the other rows are not read)
        at = jnp.full((bsz,), toks.shape[1] - 1, jnp.int32) if last else None
        logits, st, _, _ = step(params, st, toks, ids, cfg=cfg, logits_at=at)
        return logits, st

    if n_scan:
        xs = prompt[:, :n_scan * chunk].reshape(bsz, n_scan, chunk).transpose(1, 0, 2)
        state, _ = jax.lax.scan(lambda st, toks: (run(st, toks)[1], None), state, xs)
    return run(state, prompt[:, n_scan * (chunk or 0):], last=True)


def _generate_core(params, prompt, seeds, sp, stops, tables, *, cfg, max_new, chunk=PREFILL_CHUNK, penalties=False):
    """penalties: keep each row's seen tokens (prompt and output) and output counts and penalize with them, as the
    engine does (static: a program without them carries neither)."""
    bsz, plen = prompt.shape
    rows = jnp.arange(bsz)
    state = init_state(cfg, bsz, plen + max_new, params["embed_tokens"].dtype)
    logits, state = _prefill(params, state, prompt, tables, cfg, chunk)
    vocab = logits.shape[-1]
    hist = None
    if penalties:
        hist = (jnp.zeros((bsz, vocab), bool).at[rows[:, None], prompt].set(True), jnp.zeros((bsz, vocab), jnp.int32))
    tok, _ = sample(logits[:, -1], sp, row_keys(seeds, jnp.zeros((bsz,), jnp.uint32)), *(hist or ()))
    if penalties:
        hist = (hist[0].at[rows, tok].set(True), hist[1].at[rows, tok].add(1))
    out = jnp.full((bsz, max_new), -1, jnp.int32).at[:, 0].set(tok)
    done = jnp.isin(tok, stops)

    def cond(c):
        i, _, _, _, done, _ = c
        return (i < max_new) & ~jnp.all(done)

    def body(c):
        i, state, tok, out, done, hist = c
        ids = ngram_ids_device(state["ngram_ctx"], tok[:, None], tables) if tables is not None else None
        logits, state, _, _ = step(params, state, tok[:, None], ids, cfg=cfg,
                                   n_valid=jnp.where(done, 0, 1).astype(jnp.int32))
        nxt, _ = sample(logits[:, 0], sp, row_keys(seeds, jnp.full((bsz,), i, jnp.uint32)), *(hist or ()))
        if hist is not None:
            hist = (hist[0].at[rows, nxt].max(~done), hist[1].at[rows, nxt].add((~done).astype(jnp.int32)))
        nxt = jnp.where(done, -1, nxt)
        out = out.at[:, i].set(nxt)
        done = done | jnp.isin(nxt, stops)
        return i + 1, state, jnp.maximum(nxt, 0), out, done, hist

    _, _, _, out, _, _ = jax.lax.while_loop(cond, body, (jnp.asarray(1), state, tok, out, done, hist))
    return out, jnp.sum(out >= 0, axis=1)


_jit_core = jax.jit(_generate_core, static_argnames=("cfg", "max_new", "chunk", "penalties"))
