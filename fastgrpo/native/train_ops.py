"""The fused training ops of fastgrpo.models.fused_layer (csrc/jit/train_ops.cpp + train_attn.cpp),
JIT-compiled with OpenMP on first use for this machine.

`ops_module()` returns the compiled module, or None (`FASTGRPO_FUSED_LAYERS=0`, or the build
failed with a warning): the model's own layers then run. Build, cache, lock and fallback are
`fastgrpo.native.jit`'s.
"""
from __future__ import annotations

import functools
from typing import Optional

from fastgrpo import env
from fastgrpo.native import jit as _jit

# a concurrent build takes ~20 s; past this the waiting process warns and keeps the model's layers
LOCK_TIMEOUT_S = 300
STEM = "train_ops"


def sources():
    return [_jit.source("train_ops.cpp"), _jit.source("train_attn.cpp")]


def build_dir() -> str:
    """Where this machine's build lives (see fastgrpo.native.jit)."""
    return _jit.build_dir(STEM, sources(), openmp=True)


@functools.lru_cache(maxsize=None)
def _load():
    # openmp: at::parallel_for in the source runs on torch's threads (serial without it)
    # eta: ~40 s measured on the 2-core CI machine (two translation units, OpenMP)
    return _jit.build(STEM, sources(), "the fused training layers", "the model's own layers", LOCK_TIMEOUT_S,
                      openmp=True, eta_s=40)


def ops_module() -> Optional[object]:
    """The compiled train_ops module, or None (see the module doc)."""
    if not env.fused_layers():
        return None
    return _load()
