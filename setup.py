"""The kernels' shared libraries, compiled when runlm is installed: kernels.cpp as the native runtime's plain C
library, once per instruction-set variant (runlm.native.build.variants; the one the CPU runs is chosen at run time).
Everything else about the package is in pyproject.toml."""

import copy
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runlm.native import build  # noqa: E402  (build.py reads only the standard library)


class BuildKernels(build_ext):
    """Builds the variants two at a time, and leaves out one this compiler cannot build (an old compiler without
    AMX, say): that variant is then compiled at first use on a CPU that needs it, if ever."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = min(4, os.cpu_count() or 1)

    def build_extension(self, ext):
        # Every variant compiles the one kernels.cpp, and two variants built at once would write one object file (a
        # link that fails on the other's half-written object, or one variant's code in another's library): each
        # builds in a folder of its own, on a copy of this command (the variants build on threads of one command).
        own = copy.copy(self)
        own.build_temp = os.path.join(self.build_temp, ext.name.rsplit(".", 1)[-1])
        try:
            build_ext.build_extension(own, ext)
        except Exception as exc:  # noqa: BLE001  a compiler error of one variant
            print(f"runlm: not building {ext.name} ({exc}); it is compiled at first use where needed",
                  file=sys.stderr)


def kernels(name: str) -> Extension:
    source = os.path.relpath(build.SOURCE, os.path.dirname(os.path.abspath(__file__)))
    return Extension(
        f"runlm.native._kernels_{name}",
        sources=[source],
        depends=[os.path.relpath(part, os.path.dirname(os.path.abspath(__file__))) for part in build.SOURCES],
        language="c++",
        extra_compile_args=[*build.STANDALONE_FLAGS, *build.variant_cflags(name), "-g0",
                            f'-DRUNLM_SOURCE_KEY="{build.source_key(name)}"'],
        extra_link_args=["-fopenmp"],
    )


setup(ext_modules=[kernels(name) for name in build.variants()], cmdclass={"build_ext": BuildKernels})
