"""The simulated engine: the interface of `rtp_serve.engine.AsyncLLM` without torch or a model.

A paged block pool with prefix caching and LRU eviction (engine/block_pool.py, the real
one), a continuous-batching step loop whose step times come from a cost profile fitted on
the real engine (cost.py), and deterministic token ids. The workers' serving code runs on it
unchanged (`rtp-serve sim-worker`, services/sim/); many share one process.
"""
