"""The native decode step and sampler (csrc/jit/decode_step.cpp + decode_gemm.cpp + sampler.cpp),
JIT-compiled on first use for this machine.

`decode_step_module()` returns the compiled module, or None where it cannot be had (no C++
compiler or ninja, a failed build, or `FASTGRPO_NATIVE_DECODE=0`); callers then take the Python
step, which computes the same thing. The build (≈ 30 s on the 2-core machine, once, announced on
stderr) and its cache, lock and fallback are `fastgrpo.native.jit`'s.
"""
from __future__ import annotations

import functools
from typing import Optional

from fastgrpo import env

from fastgrpo.native import jit as _jit

# a concurrent build takes ~20 s; past this the waiting process warns and takes the Python step
LOCK_TIMEOUT_S = 300
STEM = "decode_step"


def sources():
    """The step, its GEMMs and the sampler, bound into one module (decode_step.cpp declares the
    sampler; decode_gemm.h the GEMMs)."""
    return [_jit.source("decode_step.cpp"), _jit.source("decode_gemm.cpp"), _jit.source("sampler.cpp")]


def enabled() -> bool:
    return env.native_decode()


def build_dir() -> str:
    """Where this machine's build lives (see fastgrpo.native.jit)."""
    return _jit.build_dir(STEM, sources(), openmp=True)


@functools.lru_cache(maxsize=None)
def _load():
    # openmp: the streamed GEMMs (weights past 1 MiB, decode_step.cpp's gemm_nk) split their
    # weight rows over torch's threads with at::parallel_for (serial without it)
    return _jit.build(STEM, sources(), "the native decode step", "the Python step", LOCK_TIMEOUT_S, openmp=True)


def decode_step_module() -> Optional[object]:
    """The compiled decode-step module, or None (see the module doc)."""
    if not enabled():
        return None
    return _load()
