"""Reference builders: tiny random-weight transformers models, saved as safetensors and GGUF."""
