"""Loader of the compiled extension `fastgrpo._C` (csrc/, pybind11).

`C` is the module, or None when it was not built or FASTGRPO_DISABLE_EXT=1; callers then use
the pure-Python twin of each function (fastgrpo/packing/bins.py). Tests run both and compare.
"""
from __future__ import annotations

from fastgrpo import env

C = None
if not env.disable_ext():
    try:
        from fastgrpo import _C as C  # type: ignore[attr-defined, no-redef]
    except ImportError:
        C = None


def available() -> bool:
    return C is not None
