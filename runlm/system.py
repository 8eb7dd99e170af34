"""What runlm reads of the machine it runs on: the CPU's name and flags, and memory (Linux's /proc; elsewhere the
answers degrade to what `platform` knows, or None)."""

from __future__ import annotations

import platform


def _cpuinfo_field(*names: str) -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith(names):
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where Linux gives them (a VM often shows only "AMD
    EPYC": family 25 is Zen 3 / 4, 26 Zen 5)."""
    name = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    family, model = _cpuinfo_field("cpu family"), _cpuinfo_field("model\t")
    return f"{name} (family {family}, model {model})" if family and model else name


def cpu_flags() -> str:
    """The first CPU's feature flags as /proc/cpuinfo lists them ("" where unknown)."""
    return _cpuinfo_field("flags", "Features") or ""


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field ("MemTotal", "MemAvailable") in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
