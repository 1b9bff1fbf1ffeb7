"""JIT builds of fastgrpo's host-tuned C++ sources in csrc/jit/ (torch.utils.cpp_extension), shared
by the native decode step (decode_step.cpp + sampler.cpp, loaded by fastgrpo.native.decode_step)
and the fused training layers (train_ops.cpp + train_attn.cpp, fastgrpo.native.train_ops).

Each source is compiled on first use with `-O3 -march=native` into `$FASTGRPO_EXT_DIR` (default
`~/.cache/fastgrpo/ext`), in a folder named by a hash of the source, the torch and Python
versions and the CPU's flags: a cache shared by different machines never hands one the other's
binary. Concurrent builds (several ranks starting at once) are serialised by an `flock` on the
build folder, which the kernel releases when its holder dies; a lock file left by a build killed
midway (torch's own, which would make the next build wait forever) is removed under it. Any
failure (no compiler or ninja, a broken source, a lock held past the timeout) warns once and
returns None: every caller has a Python path computing the same thing.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
import warnings
from typing import List, Optional, Sequence, Union

from fastgrpo import env


def _cpu_flags() -> str:
    from fastgrpo.native import cpuinfo

    return cpuinfo.flags()


_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd"]


def source_dir() -> str:
    """csrc/jit/ of a source checkout (editable installs), else the copy a wheel installs as
    fastgrpo/native/csrc/ (setup.py)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "..", "..", "csrc", "jit"), os.path.join(here, "csrc")):
        if os.path.isfile(os.path.join(cand, "native_math.h")):
            return os.path.normpath(cand)
    raise FileNotFoundError(f"fastgrpo's C++ sources (csrc/jit/) are neither next to {here} nor installed in it")


def source(name: str) -> str:
    """Path of one file of csrc/jit/."""
    return os.path.join(source_dir(), name)


def headers() -> List[str]:
    """The headers the sources include (part of every build's hash)."""
    return [source("native_math.h")]


def _sources(source) -> List[str]:
    return [source] if isinstance(source, str) else list(source)


def build_dir(stem: str, source: Union[str, Sequence[str]], openmp: bool = False) -> str:
    """Where this machine's build of `source` (one file or several) lives (see the module doc)."""
    import torch

    parts = []
    for path in _sources(source) + headers():
        with open(path, "rb") as f:
            parts.append(f.read())
    flags = " ".join(_CFLAGS + (["-fopenmp"] if openmp else []))
    key = hashlib.sha256(b"\0".join(parts + [torch.__version__.encode(), sys.version.encode(),
                                             _cpu_flags().encode(), flags.encode()])).hexdigest()[:16]
    return os.path.join(env.ext_dir(), f"{stem}_{key}")


def build(stem: str, source: Union[str, Sequence[str]], what: str, fallback: str, lock_timeout_s: float,
          openmp: bool = False) -> Optional[object]:
    """The compiled module of `source`, or None after a warning naming `what` and `fallback`.
    `openmp`: compile and link with -fopenmp, so that `at::parallel_for` in the source runs on
    torch's threads (without it the loops are serial: ATen's parallel_for is an OpenMP pragma
    compiled into the extension)."""
    from torch.utils.cpp_extension import load

    try:
        folder = build_dir(stem, source, openmp)
        key = os.path.basename(folder)[len(stem) + 1:]
        import fcntl  # POSIX; elsewhere the ImportError means: the Python path

        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, ".fastgrpo.lock"), "w") as lock:
            deadline = time.monotonic() + lock_timeout_s
            while True:  # a holder that is stuck must not hang every other rank
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{folder} is locked by another build for over {lock_timeout_s} s")
                    time.sleep(0.2)
            stale = os.path.join(folder, "lock")  # torch's baton, left by a build killed midway
            if os.path.exists(stale):
                os.remove(stale)
            env.ninja_on_path()
            omp = ["-fopenmp"] if openmp else []
            return load(name=f"fastgrpo_{stem}_{key}", sources=_sources(source), build_directory=folder,
                        extra_cflags=_CFLAGS + omp, extra_ldflags=omp, verbose=False)
    except Exception as e:  # noqa: BLE001 — any build failure means: the Python path
        msg = str(e).strip().splitlines()
        warnings.warn(f"fastgrpo: {what} could not be built ({type(e).__name__}: "
                      f"{msg[-1] if msg else ''}); {fallback} is used", RuntimeWarning, stacklevel=4)
        return None
