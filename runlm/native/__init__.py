"""The native runtime: GGUF models on runlm's C++ kernels, in a process that never imports PyTorch.

`weights` reads a GGUF file's tensors into the layouts the kernels read (regrouped in C at load; nothing written to
disk); `model` builds each block from the family's spec (runlm.families) as one C struct and runs forwards over
sessions; `runner` is the runner contract over it; `loader` adds the tokenizer and chat template (what runlm.load
returns for a GGUF file on a CPU); `library` is the kernels' C interface through ctypes.
"""
