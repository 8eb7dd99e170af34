"""Model families, each described once: a short declarative spec (runlm.families.spec) that every runtime reads.

The native runtime (runlm.native) builds its C++ blocks from a spec; the PyTorch backend (runlm.pytorch) builds its
modules from the same spec. Adding a dense family that needs no new kernel is one file here plus its tests.
Nothing in this package imports PyTorch.
"""

from runlm.families.registry import for_gguf, for_hf, register, specs, supported
from runlm.families.spec import FamilySpec

__all__ = ["FamilySpec", "for_gguf", "for_hf", "register", "specs", "supported"]
