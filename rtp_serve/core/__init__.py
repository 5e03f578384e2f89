"""The torch-free contract every process imports: block hashing and salt, sampling
parameters and their validation, structured-output specs, the tokenizer and chat template,
dtype names, the model's config, the cost model and the LoRA config. Nothing here imports
torch, the engine or the services (tests/test_boundaries.py)."""
