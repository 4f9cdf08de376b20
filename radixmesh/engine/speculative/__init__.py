"""Speculative decoding: drafts (engine.speculative.ngram) and their verification in one target forward."""
