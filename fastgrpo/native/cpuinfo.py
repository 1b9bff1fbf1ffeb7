"""What the CPU is: /proc/cpuinfo fields (vendor, flags), read once per key.

Used where a choice depends on the CPU: the oneDNN-vs-MKL routing of float32 linears
(fastgrpo.models.onednn: AMD CPUs with AVX-512) and the hash of JIT builds (fastgrpo.native.jit:
a build cache shared by different machines never hands one the other's binary).
"""
from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=None)
def field(key: str) -> str:
    """The value of the first `key` line of /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return ""


def vendor() -> str:
    """"GenuineIntel", "AuthenticAMD", … ("" off x86 Linux)."""
    return field("vendor_id")


def flags() -> str:
    """The CPU's feature flags (x86 `flags`, Arm `Features`), else the platform's name."""
    return field("flags") or field("Features") or platform.processor() or platform.machine()
