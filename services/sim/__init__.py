"""`rtp-serve sim-worker`: workers that speak every real protocol over a simulated engine
(rtp_serve.engine.sim): no torch, no model, many to a process. Torch-free
(tests/test_boundaries.py)."""
