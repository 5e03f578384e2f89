"""Tools that build checkpoints: the tiny test models (make_model), GGUF conversion of trained
ones (convert/), LoRA adapters (make_adapter), and the safetensors writer they share."""
