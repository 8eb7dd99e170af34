"""The PyTorch backend (the `torch` extra): what the native runtime does not run — Hugging Face directories, GPUs,
the float32 reference, the Gemma 3 vision tower.

`loading` is its load; `registry` and `decoder` build a family's modules from its spec (runlm.families); `base` holds
the weight loader, the decoder and the cached runner; `nn` the layers; `fused` the C++ blocks it shares with the
native runtime; `kernels` those kernels as a PyTorch extension, `int4` torch's int4 fallback and `dequant` the
reference dequantization of GGUF blocks; `gemma3` and `vision` Gemma 3's image path.
"""
