"""Host side of the PLE layer: n-gram ids, the row store, prefetch (no JAX model code)."""

from fnx.ple.ngram import NgramConstants, context_after, initial_context, ngram_ids

__all__ = ["NgramConstants", "context_after", "initial_context", "ngram_ids"]
