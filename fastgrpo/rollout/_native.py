"""The native decode step (lean_step.cpp), JIT-compiled on first use for this machine.

`lean_step_module()` returns the compiled module, or None where it cannot be had (no C++
compiler or ninja, a failed build, or `FASTGRPO_NATIVE_DECODE=0`); callers then take the Python
step, which computes the same thing. The build (≈ 20 s on the 2-core machine, once) goes to
`$FASTGRPO_EXT_DIR` (default `~/.cache/fastgrpo/ext`), in a folder named by a hash of the source,
the torch and Python versions and the CPU's flags, because it is compiled with `-march=native`:
a cache shared by different machines never hands one the other's binary. Concurrent builds
(several ranks starting at once) are serialised by an `flock` on the build folder, which the
kernel releases when its holder dies; a lock file left by a build killed midway (torch's own,
which would make the next build wait forever) is removed under it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from typing import Optional

from .. import env

# a concurrent build takes ~20 s; past this the waiting process warns and takes the Python step
LOCK_TIMEOUT_S = 300
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lean_step.cpp")


def _cpu_flags() -> str:
    from ..cpu_gemm import cpuinfo

    return cpuinfo("flags") or cpuinfo("Features") or platform.processor() or platform.machine()


def enabled() -> bool:
    return env.native_decode()


def build_dir() -> str:
    """Where this machine's build of SOURCE lives (see the module doc)."""
    import torch

    with open(SOURCE, "rb") as f:
        src = f.read()
    key = hashlib.sha256(b"\0".join([src, torch.__version__.encode(), sys.version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    return os.path.join(env.ext_dir(), f"lean_step_{key}")


@functools.lru_cache(maxsize=None)
def _load():
    from torch.utils.cpp_extension import load

    try:
        build = build_dir()
        key = os.path.basename(build)[len("lean_step_"):]
        import fcntl  # POSIX; elsewhere the ImportError means: the Python step

        os.makedirs(build, exist_ok=True)
        with open(os.path.join(build, ".fastgrpo.lock"), "w") as lock:
            deadline = time.monotonic() + LOCK_TIMEOUT_S
            while True:  # a holder that is stuck must not hang every other rank
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{build} is locked by another build for over {LOCK_TIMEOUT_S} s")
                    time.sleep(0.2)
            stale = os.path.join(build, "lock")  # torch's baton, left by a build killed midway
            if os.path.exists(stale):
                os.remove(stale)
            env.ninja_on_path()
            return load(name=f"fastgrpo_lean_step_{key}", sources=[SOURCE], build_directory=build,
                        extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
    except Exception as e:  # noqa: BLE001 — any build failure means: use the Python step
        msg = str(e).strip().splitlines()
        warnings.warn(f"fastgrpo: the native decode step could not be built ({type(e).__name__}: "
                      f"{msg[-1] if msg else ''}); the Python step is used", RuntimeWarning, stacklevel=3)
        return None


def lean_step_module() -> Optional[object]:
    """The compiled lean_step module, or None (see the module doc)."""
    if not enabled():
        return None
    return _load()
