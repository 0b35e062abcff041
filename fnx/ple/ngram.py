"""Hashed n-gram ids of the PLE layer (host-side NumPy, int64)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

_MASK64 = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007

# Witnesses that make Miller-Rabin exact for every n < 3.3e24.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return value ^ (value >> 31)


def _layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> list[int]:
    # Odd multipliers below INT64_MAX // vocab_size, so token * mult never overflows int64.
    half_bound = max(1, (_INT64_MAX // vocab_size) // 2)
    base_seed = seed + _LAYER_SEED_STRIDE * ple_layer_index
    return [
        2 * (_splitmix64((base_seed + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1
        for i in range(ngram_size)
    ]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= start, ascending."""
    primes = []
    candidate = start
    while len(primes) < count:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes


def _require_int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True, eq=False)
class NgramConstants:
    """Per-PLE-layer hash constants. Arrays are int64 and read-only."""

    multipliers: np.ndarray  # [ngram_size]
    head_vocab_sizes: np.ndarray  # [H], H = (ngram_size - 1) * heads_per_ngram
    head_offsets: np.ndarray  # [H], prefix sums of head_vocab_sizes
    num_rows: int  # table rows, sum(head_vocab_sizes) padded to the divisor
    ngram_size: int
    heads_per_ngram: int
    eos_token_id: int

    def __post_init__(self) -> None:
        ngram_size = _require_int("ngram_size", self.ngram_size, 2)
        heads_per_ngram = _require_int("heads_per_ngram", self.heads_per_ngram, 1)
        eos = _require_int("eos_token_id", self.eos_token_id, 0)
        num_rows = _require_int("num_rows", self.num_rows, 1)
        num_heads = (ngram_size - 1) * heads_per_ngram
        for name, length in (
            ("multipliers", ngram_size),
            ("head_vocab_sizes", num_heads),
            ("head_offsets", num_heads),
        ):
            arr = np.array(getattr(self, name))
            if arr.shape != (length,) or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{name} must be an integer array of shape ({length},), got {arr.dtype} {arr.shape}")
            arr = arr.astype(np.int64)
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        if np.any(self.head_vocab_sizes < 1):
            raise ValueError(f"head_vocab_sizes must be positive, got {self.head_vocab_sizes.tolist()}")
        total = int(self.head_offsets[-1]) + int(self.head_vocab_sizes[-1])
        if num_rows < total:
            raise ValueError(f"num_rows ({num_rows}) is smaller than the {total} rows the heads use")
        for name, value in (("ngram_size", ngram_size), ("heads_per_ngram", heads_per_ngram),
                            ("eos_token_id", eos), ("num_rows", num_rows)):
            object.__setattr__(self, name, value)

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @cached_property
    def _py(self) -> tuple[list[int], list[list[tuple[int, int]]]]:
        """The multipliers and, per n-gram order, each head's (size, offset) as Python ints (`hash_rows`)."""
        h = self.heads_per_ngram
        heads = list(zip(self.head_vocab_sizes.tolist(), self.head_offsets.tolist()))
        return self.multipliers.tolist(), [heads[i * h:(i + 1) * h] for i in range(self.ngram_size - 1)]

    @classmethod
    def build(
        cls,
        vocab_size: int,
        ngram_size: int,
        heads_per_ngram: int,
        ngram_vocab_size_base: int,
        vocab_divisor: int,
        seed: int,
        ple_layer_index: int,
        eos_token_id: int,
    ) -> NgramConstants:
        vocab_size = _require_int("vocab_size", vocab_size, 1)
        ngram_size = _require_int("ngram_size", ngram_size, 2)
        heads_per_ngram = _require_int("heads_per_ngram", heads_per_ngram, 1)
        base = _require_int("ngram_vocab_size_base", ngram_vocab_size_base, 1)
        divisor = _require_int("vocab_divisor", vocab_divisor, 1)
        seed = _require_int("seed", seed)
        ple_layer_index = _require_int("ple_layer_index", ple_layer_index, 0)
        eos = _require_int("eos_token_id", eos_token_id, 0)
        if eos >= vocab_size:
            raise ValueError(f"eos_token_id must be < vocab_size ({vocab_size}), got {eos}")

        num_heads = (ngram_size - 1) * heads_per_ngram
        # Layer p owns primes number p*H+1 .. p*H+H (counting from 1) among the primes >= base.
        sizes = _primes_from(base, (ple_layer_index + 1) * num_heads)[-num_heads:]
        offsets = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]).astype(np.int64)
        total = sum(sizes)
        return cls(
            multipliers=np.array(_layer_multipliers(vocab_size, ngram_size, ple_layer_index, seed), dtype=np.int64),
            head_vocab_sizes=np.array(sizes, dtype=np.int64),
            head_offsets=offsets,
            num_rows=-(-total // divisor) * divisor,
            ngram_size=ngram_size,
            heads_per_ngram=heads_per_ngram,
            eos_token_id=eos,
        )

    @classmethod
    def from_config(cls, cfg: Any, ple_layer_index: int = 0) -> NgramConstants:
        eos = cfg.eos_token_id
        if isinstance(eos, (list, tuple)):
            if not eos:
                raise ValueError("eos_token_id must not be an empty list")
            eos = eos[0]
        if eos is None:
            raise ValueError("eos_token_id must be set for the n-gram embedding")
        return cls.build(
            vocab_size=cfg.vocab_size,
            ngram_size=cfg.ngram_size,
            heads_per_ngram=cfg.heads_per_ngram,
            ngram_vocab_size_base=cfg.ngram_vocab_size_base,
            vocab_divisor=cfg.make_ngram_vocab_size_divisible_by,
            seed=cfg.seed,
            ple_layer_index=ple_layer_index,
            eos_token_id=eos,
        )


def initial_context(batch: int, consts: NgramConstants) -> np.ndarray:
    """Context at the start of a sequence: [B, ngram_size - 1] int64 filled with eos."""
    batch = _require_int("batch", batch, 1)
    return np.full((batch, consts.ngram_size - 1), consts.eos_token_id, dtype=np.int64)


def _as_ids(name: str, value: Any, ndim: int, vocab_size: int | None) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {arr.shape}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            raise ValueError(f"{name} must hold non-negative token ids, got {lo}")
        limit = _INT64_MAX if vocab_size is None else vocab_size - 1
        if hi > limit:
            raise ValueError(f"{name} holds token id {hi}, above the allowed maximum {limit}")
    return arr.astype(np.int64, copy=False)


# Calls of up to this many tokens hash with Python ints (`hash_rows`): a decode step's few tokens cost NumPy's
# per-operation overhead dozens of times over in the vectorised path (2-core CPU VM, release constants, the
# engine's ids of one step: 1 token 47 -> 8 us, 16 tokens 97 -> 60 us; even at 40 tokens).
SMALL_TOKENS = 16


def hash_rows(rows: list[list[int]], length: int, consts: NgramConstants) -> np.ndarray:
    """The ids [B, L, H] int64 of the last `length` tokens of each row, rows[b] = its n-1 context ids followed by
    its `length` tokens (token ids of the vocabulary the constants were built for; `ngram_ids` validates): the
    arithmetic of `ngram_ids` with Python ints, exact (every product is below 2^63 by the multipliers' bound, XOR
    and % of non-negative ints)."""
    n_ctx = consts.ngram_size - 1
    eos = consts.eos_token_id
    mult, heads = consts._py
    out = []
    for hist in rows:
        for pos in range(n_ctx, n_ctx + length):
            mix = hist[pos] * mult[0]
            blocked = False
            ids = []
            for s in range(1, n_ctx + 1):
                prev = hist[pos - s]
                blocked = blocked or prev == eos       # an EOS within the last s predecessors
                mix ^= (eos if blocked else prev) * mult[s]
                ids += [mix % size + off for size, off in heads[s - 1]]
            out.append(ids)
    return np.array(out, dtype=np.int64).reshape(len(rows), length, consts.num_heads)


def ngram_ids(
    context: np.ndarray,
    tokens: np.ndarray,
    consts: NgramConstants,
    *,
    vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Table rows of each token's n-grams, and the context for the next call.

    context: [B, n-1] previous ids (initial_context at a sequence start); tokens: [B, L].
    Returns ids [B, L, H] int64 (bigram heads first, then trigram heads, ...) and
    new_context [B, n-1] = last n-1 ids of concat(context, tokens).
    An EOS ends its segment: tokens after it see eos for every predecessor up to and
    including that EOS. If vocab_size is given, token ids must be below it.
    """
    n_ctx = consts.ngram_size - 1
    context = _as_ids("context", context, 2, vocab_size)
    tokens = _as_ids("tokens", tokens, 2, vocab_size)
    if context.shape[1] != n_ctx:
        raise ValueError(f"context must have shape [B, {n_ctx}], got {context.shape}")
    if context.shape[0] != tokens.shape[0]:
        raise ValueError(f"context batch {context.shape[0]} != tokens batch {tokens.shape[0]}")
    batch, length = tokens.shape
    eos = consts.eos_token_id

    hist = np.concatenate([context, tokens], axis=1)  # [B, n-1+L]
    if tokens.size <= SMALL_TOKENS and int(hist.max(initial=0)) <= _INT64_MAX // int(consts.multipliers.max()):
        # (ids past that bound, outside any vocabulary, wrap in int64 on the vectorised path: kept there)
        new_context = np.ascontiguousarray(hist[:, hist.shape[1] - n_ctx:])
        return hash_rows(hist.tolist(), length, consts), new_context
    is_eos = hist == eos  # [B, n-1+L]
    mult = consts.multipliers
    sizes = consts.head_vocab_sizes.reshape(consts.ngram_size - 1, consts.heads_per_ngram)
    offsets = consts.head_offsets.reshape(consts.ngram_size - 1, consts.heads_per_ngram)

    ids = np.empty((batch, length, consts.ngram_size - 1, consts.heads_per_ngram), dtype=np.int64)
    mix = tokens * mult[0]  # [B, L]
    blocked = np.zeros((batch, length), dtype=bool)  # an eos lies in the last s predecessors
    for s in range(1, consts.ngram_size):
        prev = hist[:, n_ctx - s : n_ctx - s + length]  # [B, L], token s steps back
        blocked |= is_eos[:, n_ctx - s : n_ctx - s + length]
        mix = mix ^ (np.where(blocked, eos, prev) * mult[s])
        ids[:, :, s - 1] = np.remainder(mix[:, :, None], sizes[s - 1]) + offsets[s - 1]

    new_context = np.ascontiguousarray(hist[:, hist.shape[1] - n_ctx :])
    return ids.reshape(batch, length, consts.num_heads), new_context


def context_after(context: np.ndarray, tokens: np.ndarray, n_accepted: Any, consts: NgramConstants) -> np.ndarray:
    """The context after only the first n_accepted[b] of `tokens` were kept (rollback after an MTP verify).

    context: [B, n-1] the context *before* the verify window (what `ngram_ids` was called with);
    tokens: [B, L] the window that was hashed; n_accepted: int or [B] ints in [0, L].
    Returns [B, n-1] int64 = last n-1 ids of concat(context[b], tokens[b, :n_accepted[b]]), exactly what
    `ngram_ids(context, tokens[:, :n_accepted])` would have returned for that row.
    """
    n_ctx = consts.ngram_size - 1
    context = _as_ids("context", context, 2, None)
    tokens = _as_ids("tokens", tokens, 2, None)
    if context.shape[1] != n_ctx:
        raise ValueError(f"context must have shape [B, {n_ctx}], got {context.shape}")
    batch, length = tokens.shape
    if context.shape[0] != batch:
        raise ValueError(f"context batch {context.shape[0]} != tokens batch {batch}")
    acc = np.asarray(n_accepted)
    if acc.dtype == np.bool_ or not np.issubdtype(acc.dtype, np.integer):
        raise ValueError(f"n_accepted must be integers, got dtype {acc.dtype}")
    acc = np.broadcast_to(acc.astype(np.int64), (batch,)) if acc.ndim == 0 else acc.astype(np.int64)
    if acc.shape != (batch,):
        raise ValueError(f"n_accepted must be a scalar or shaped [{batch}], got {acc.shape}")
    if acc.size and (acc.min() < 0 or acc.max() > length):
        raise ValueError(f"n_accepted must lie in [0, {length}] (the window length), got {acc.tolist()}")
    hist = np.concatenate([context, tokens], axis=1)  # [B, n-1+L]
    # Row b keeps hist[b, acc[b] : acc[b] + n-1]: the n-1 ids that end at its last accepted token.
    cols = acc[:, None] + np.arange(n_ctx, dtype=np.int64)[None, :]
    return np.take_along_axis(hist, cols, axis=1)
