"""Sampling: greedy, temperature, top-k, top-p, min-p, repetition / presence / frequency penalties, a seed per
request, and top-n logprobs. Per-row parameters are arrays, so one compiled program serves any mix of requests."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = jnp.float32


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k <= 0 and top_p = 1 and min_p = 0 switch those filters off."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0     # divides positive / multiplies negative logits of seen tokens (prompt+output)
    presence_penalty: float = 0.0       # subtracted once from every token already generated
    frequency_penalty: float = 0.0      # subtracted per occurrence in the generated tokens
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0                   # top-n logprobs to return with each token (0: only the chosen one)
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's logprob (the first: None) and top n
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]) added to its logit

    def __post_init__(self):
        def bad(field_name, value, why):
            raise ValueError(f"{field_name} {why}, got {value!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "must be in [0, 1]")
        if not isinstance(self.top_k, (int, np.integer)) or not -1 <= self.top_k < 2**31:
            bad("top_k", self.top_k, "must be an integer in [-1, 2^31)")
        for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(self, name)):
                bad(name, getattr(self, name), "must be finite")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**32):
            bad("seed", self.seed, "must be an integer in [0, 2^32)")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not isinstance(self.max_tokens, (int, np.integer)) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "must be a positive integer")
        if not 0 <= self.logprobs <= 20:
            bad("logprobs", self.logprobs, "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", self.prompt_logprobs, "must be None or in [0, 20]")
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", self.logit_bias, f"must be a tuple of at most {MAX_LOGIT_BIAS} (token id, bias) pairs")
        for pair in self.logit_bias:
            ok = isinstance(pair, tuple) and len(pair) == 2
            if not ok or not isinstance(pair[0], (int, np.integer)) or pair[0] < 0 or isinstance(pair[0], bool):
                bad("logit_bias", pair, "must hold (token id >= 0, bias) pairs")
            if not (isinstance(pair[1], (int, float, np.floating, np.integer)) and np.isfinite(pair[1])
                    and -100 <= pair[1] <= 100):
                bad("logit_bias", pair, "must hold biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


# a request's logit_bias entries at most (OpenAI's limit); a batch with any has [B, MAX_LOGIT_BIAS] bias arrays, a
# batch without any [B, 0] ones, so its programs carry no bias op at all
MAX_LOGIT_BIAS = 300


@jax.tree_util.register_dataclass
@dataclass
class SamplingArrays:
    """SamplingParams of B rows as arrays [B] (the logit bias as [B, 0 or MAX_LOGIT_BIAS] ids and values, padded
    with (0, 0.0))."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    bias_ids: jax.Array
    bias_vals: jax.Array

    @classmethod
    def stack(cls, params: list[SamplingParams]) -> "SamplingArrays":
        """The rows' parameters as device arrays; the logit bias padded to MAX_LOGIT_BIAS entries a row when any
        row has one, else [B, 0] arrays (no bias op in the programs)."""
        col = lambda name, dt: jnp.asarray(np.array([getattr(p, name) for p in params], dt))  # noqa: E731
        width = MAX_LOGIT_BIAS if any(p.logit_bias for p in params) else 0
        ids, vals = np.zeros((len(params), width), np.int32), np.zeros((len(params), width), np.float32)
        for r, p in enumerate(params if width else ()):
            for j, (t, b) in enumerate(p.logit_bias):
                ids[r, j], vals[r, j] = t, b
        return cls(col("temperature", np.float32), col("top_k", np.int32), col("top_p", np.float32),
                   col("min_p", np.float32), col("repetition_penalty", np.float32),
                   col("presence_penalty", np.float32), col("frequency_penalty", np.float32),
                   jnp.asarray(ids), jnp.asarray(vals))


def apply_logit_bias(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
    """logits [B, V] f32 with each row's logit_bias added (the padding adds 0.0 to token 0). A batch without any
    bias (arrays [B, 0]) gets the logits as they are: no op in its program."""
    if sp.bias_ids.shape[-1] == 0:
        return logits
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, sp.bias_ids].add(sp.bias_vals)


def apply_penalties(logits: jax.Array, sp: SamplingArrays, seen: jax.Array, out_counts: jax.Array) -> jax.Array:
    """logits [B, V] f32; seen [B, V] bool (prompt and output tokens); out_counts [B, V] int32 (output tokens)."""
    rp = sp.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - sp.presence_penalty[:, None] * (out_counts > 0) - sp.frequency_penalty[:, None] * out_counts
    return logits


def filtered_logprobs(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
    """The log-distribution sampling draws from: temperature, then top-k, top-p and min-p, as log-probabilities
    [B, V] (-inf where filtered). Rows with temperature 0 get a one-hot on the argmax."""
    vocab = logits.shape[-1]
    greedy = sp.temperature <= 0
    t = jnp.where(greedy, 1.0, sp.temperature)[:, None]
    lp = jax.nn.log_softmax(logits / t, axis=-1)
    order = jnp.argsort(-lp, axis=-1)                          # descending; ties keep the lower id first
    sorted_lp = jnp.take_along_axis(lp, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, vocab), vocab)[:, None]
    keep = rank < k
    probs = jnp.exp(sorted_lp)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= cum_before < sp.top_p[:, None]
    keep &= probs >= sp.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    kept_sorted = jnp.where(keep, sorted_lp, -jnp.inf)
    kept = jnp.full_like(lp, -jnp.inf).at[jnp.arange(lp.shape[0])[:, None], order].set(kept_sorted)
    kept = jax.nn.log_softmax(kept, axis=-1)
    onehot = jnp.where(jnp.arange(vocab)[None, :] == jnp.argmax(logits, axis=-1)[:, None], 0.0, -jnp.inf)
    return jnp.where(greedy[:, None], onehot, kept)


@jax.jit
def row_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """One PRNG key per row from its seed and a per-row counter (the number of tokens it has sampled). Jitted:
    the engine calls it between programs, where an eager vmap would dispatch its PRNG ops one by one."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)


def sample(logits: jax.Array, sp: SamplingArrays, keys: jax.Array, seen=None, out_counts=None):
    """logits [B, V] -> (tokens [B] int32, the filtered log-distribution [B, V])."""
    logits = logits.astype(F32)
    if seen is not None:
        logits = apply_penalties(logits, sp, seen, out_counts)
    lp = filtered_logprobs(apply_logit_bias(logits, sp), sp)
    tok = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, lp).astype(jnp.int32)
    return tok, lp


def greedy_tokens(logits: jax.Array, sp: SamplingArrays, seen=None, out_counts=None) -> jax.Array:
    """`sample`'s tokens when every row is at temperature 0: the argmax of the penalized logits (the one-hot row
    `filtered_logprobs` gives greedy rows), without the sort, cumsum and scatter over the vocabulary that the
    sampled rows need."""
    logits = logits.astype(F32)
    if seen is not None:
        logits = apply_penalties(logits, sp, seen, out_counts)
    return jnp.argmax(apply_logit_bias(logits, sp), axis=-1).astype(jnp.int32)


def top_logprobs(logits: jax.Array, chosen: jax.Array, n: int):
    """Raw model log-probabilities: the chosen token's [B] and the top n [B, n] (values, ids)."""
    lp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    chosen_lp = jnp.take_along_axis(lp, chosen[:, None], axis=-1)[:, 0]
    vals, ids = lax.top_k(lp, max(n, 1))
    return chosen_lp, vals[:, :n], ids[:, :n]
