"""specdec: lossless speculative decoding for Hugging Face Llama-family checkpoints."""
