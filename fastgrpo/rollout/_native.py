"""The native decode step (lean_step.cpp), JIT-compiled on first use for this machine.

`lean_step_module()` returns the compiled module, or None where it cannot be had (no C++
compiler or ninja, a failed build, or `FASTGRPO_NATIVE_DECODE=0`); callers then take the Python
step, which computes the same thing. The build (≈ 20 s on the 2-core machine, once) and its
cache, lock and fallback are `fastgrpo._jit`'s.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

from .. import _jit, env

# a concurrent build takes ~20 s; past this the waiting process warns and takes the Python step
LOCK_TIMEOUT_S = 300
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lean_step.cpp")
# the sampler, bound into the same module (lean_step.cpp declares it)
SAMPLE_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_step.cpp")


def enabled() -> bool:
    return env.native_decode()


def build_dir() -> str:
    """Where this machine's build of SOURCE lives (see fastgrpo._jit)."""
    return _jit.build_dir("lean_step", [SOURCE, SAMPLE_SOURCE])


@functools.lru_cache(maxsize=None)
def _load():
    return _jit.build("lean_step", [SOURCE, SAMPLE_SOURCE], "the native decode step", "the Python step",
                      LOCK_TIMEOUT_S)


def lean_step_module() -> Optional[object]:
    """The compiled lean_step module, or None (see the module doc)."""
    if not enabled():
        return None
    return _load()
