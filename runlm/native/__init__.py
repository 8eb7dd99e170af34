"""Decoding without PyTorch: a process that holds a model's weights once and little else.

PyTorch alone is ~220 MiB resident before any model; llama.cpp's whole process is ~40 MiB before its weights. A lean
process runs the same C++ blocks as the default path (kernels.cpp, built standalone: `native`) on a lean image of
the model (`image`): the weights as the fused kernels read them, written once by a process with PyTorch
(`prepare`) and mapped here. `engine` runs forwards over sessions; `generate` is the decode loop; `cli` is
`runlm generate --lean`. Nothing under runlm.native imports torch except `prepare`, which runs in a child process.
"""
