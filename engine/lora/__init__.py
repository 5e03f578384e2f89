"""Multi-LoRA serving: PEFT adapters read (peft_config.py, torch-free) and fused onto the
engine's projections (weights.py), a bounded resident set (registry.py), and the per-row
updates of a mixed batch (batch.py). make_adapter.py writes random ones for tests."""
