"""Speculative decoding: proposers (proposer.py, ngram.py), the adaptive speculation length
(adaptive.py), verification and the acceptance rule (rejection.py), counters (stats.py),
and the component the engine composes them through (speculator.py)."""
