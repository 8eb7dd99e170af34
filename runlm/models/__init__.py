"""The PyTorch backend: layers (runlm.nn), one builder for every family spec (build), the cached runner (base), the
fused C++ blocks (fused) and the Gemma 3 vision tower (vision)."""
