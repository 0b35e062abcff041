from fnx.ple.ngram import NgramConstants, initial_context, ngram_ids

__all__ = ["NgramConstants", "initial_context", "ngram_ids"]
