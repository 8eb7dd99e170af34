"""Model families: one module each, registered with runlm.loading on import."""

from __future__ import annotations

import importlib
import pkgutil


def import_all_families() -> None:
    """Import every family module so that each registers itself."""
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")
