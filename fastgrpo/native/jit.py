"""JIT builds of fastgrpo's host-tuned C++ sources in csrc/jit/ (torch.utils.cpp_extension), shared
by the native decode step (decode_step.cpp + decode_gemm.cpp + sampler.cpp, loaded by
fastgrpo.native.decode_step) and the fused training layers (train_ops.cpp + train_attn.cpp,
fastgrpo.native.train_ops).

Each module is compiled on first use with `-O3 -march=native` into `$FASTGRPO_EXT_DIR` (default
`~/.cache/fastgrpo/ext`), in a folder named by a hash of what the compiler sees: the sources and
headers, the flags, the CPU's flags (a cache shared by different machines never hands one the
other's binary), the Python version, and torch's version and location (its include and library
paths are on the compile line). The sources are compiled from a copy inside that folder, not
from where fastgrpo is installed: torch writes their paths into the folder's build.ninja, and
ninja rebuilds whenever a command line changes, so two checkouts of the same fastgrpo used to
share one folder and rebuild it for each other on every run (seen: four rebuilds in an
afternoon). Now identical sources share one build wherever they are installed, and different
sources (or another torch) get their own folder. A build that is about to run says so on stderr,
on a line of its own beside a progress bar, first (with how long the last build of it took on
this machine, else a range: "~30 s" took 92 s on a busy 2-core box) and how long it took after.

Concurrent builds (several ranks starting at once) are serialised by an `flock` on the build
folder, which the kernel releases when its holder dies; a lock file left by a build killed
midway (torch's own, which would make the next build wait forever) is removed under it. Any
failure (no compiler or ninja, a broken source, a lock held past the timeout) warns once and
returns None: every caller has a Python path computing the same thing.
"""
from __future__ import annotations

import glob
import hashlib
import os
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
    """The headers the sources include (every csrc/jit/*.h: part of every build's hash, and
    copied beside the sources into the build folder)."""
    return sorted(glob.glob(os.path.join(source_dir(), "*.h")))


def _sources(source) -> List[str]:
    return [source] if isinstance(source, str) else list(source)


def _files(source) -> List[str]:
    """The sources and the headers, each name once (a source given from elsewhere, e.g. a test's,
    replaces the csrc/jit/ file of the same name)."""
    srcs = _sources(source)
    names = {os.path.basename(p) for p in srcs}
    return srcs + [h for h in headers() if os.path.basename(h) not in names]


def build_dir(stem: str, source: Union[str, Sequence[str]], openmp: bool = False) -> str:
    """Where this machine's build of `source` (one file or several) lives (see the module doc)."""
    import torch

    parts = []
    for path in _files(source):
        with open(path, "rb") as f:
            parts.append(os.path.basename(path).encode() + b"\0" + f.read())
    flags = " ".join(_CFLAGS + (["-fopenmp"] if openmp else []))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    key = hashlib.sha256(b"\0".join(parts + [torch.__version__.encode(), torch_dir.encode(), sys.version.encode(),
                                             _cpu_flags().encode(), flags.encode()])).hexdigest()[:16]
    return os.path.join(env.ext_dir(), f"{stem}_{key}")


def module_name(stem: str, folder: str) -> str:
    """The import name of the module built in `folder` (its key is part of it)."""
    return f"fastgrpo_{stem}_{os.path.basename(folder)[len(stem) + 1:]}"


def is_built(stem: str, source: Union[str, Sequence[str]], openmp: bool = False) -> bool:
    """Whether the build of `source` for this machine is already in the cache (no compile to wait for)."""
    folder = build_dir(stem, source, openmp)
    return os.path.isfile(os.path.join(folder, module_name(stem, folder) + ".so"))


def _copy_sources(folder: str, files: List[str]) -> List[str]:
    """The sources as copies under `folder/src/` (written once: the folder's name is their hash,
    so a copy never changes, and its unchanged mtime keeps ninja from rebuilding)."""
    dst_dir = os.path.join(folder, "src")
    os.makedirs(dst_dir, exist_ok=True)
    out = []
    for path in files:
        dst = os.path.join(dst_dir, os.path.basename(path))
        with open(path, "rb") as f:
            data = f.read()
        try:
            with open(dst, "rb") as f:
                same = f.read() == data
        except FileNotFoundError:
            same = False
        if not same:  # first build here, or a copy torn by a killed build
            tmp = f"{dst}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, dst)
        out.append(dst)
    return out


def say(msg: str) -> None:
    """A line of its own on stderr, through tqdm when a progress bar is drawn (printed beside it,
    the message was glued to the bar): what a wait of seconds to minutes is doing (a native build
    here, a GGUF conversion in fastgrpo.models.gguf)."""
    try:
        from tqdm import tqdm

        tqdm.write(f"fastgrpo: {msg}", file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm is a dependency
        print(f"fastgrpo: {msg}", file=sys.stderr, flush=True)


def _last_took(stem: str) -> Optional[float]:
    """How long the last build of `stem` took on this machine (recorded beside the builds)."""
    try:
        with open(os.path.join(env.ext_dir(), f".{stem}.seconds")) as f:
            return float(f.read().strip())
    except (OSError, ValueError):
        return None


def _record_took(stem: str, took: float) -> None:
    try:
        with open(os.path.join(env.ext_dir(), f".{stem}.seconds"), "w") as f:
            f.write(f"{took:.1f}\n")
    except OSError:
        pass


def build(stem: str, source: Union[str, Sequence[str]], what: str, fallback: str, lock_timeout_s: float,
          openmp: bool = False, eta_s: int = 30) -> Optional[object]:
    """The compiled module of `source`, or None after a warning naming `what` and `fallback`.
    `openmp`: compile and link with -fopenmp, so that `at::parallel_for` in the source runs on
    torch's threads (without it the loops are serial: ATen's parallel_for is an OpenMP pragma
    compiled into the extension). `eta_s`: the build time announced before a compile."""
    from torch.utils.cpp_extension import load

    try:
        folder = build_dir(stem, source, openmp)
        name = module_name(stem, folder)
        import fcntl  # POSIX; elsewhere the ImportError means: the Python path

        os.makedirs(folder, exist_ok=True)
        fresh = not os.path.isfile(os.path.join(folder, name + ".so"))
        if fresh:  # the estimate: this machine's last build of it (a busy 2-core box took 92 s, not ~30)
            last = _last_took(stem)
            eta = f"about {last:.0f} s, as the last build here" if last else f"{eta_s}–{3 * eta_s} s"
            say(f"compiling {what} for this CPU once, {eta} (cached in {folder}) …")
        t0 = time.monotonic()
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
            files = _copy_sources(folder, _files(source))
            omp = ["-fopenmp"] if openmp else []
            mod = load(name=name, sources=files[:len(_sources(source))], build_directory=folder,
                       extra_cflags=_CFLAGS + omp, extra_ldflags=omp, verbose=False)
        took = time.monotonic() - t0
        if fresh:
            say(f"{what} built in {took:.0f} s")
            _record_took(stem, took)
        elif took > 5.0:  # ninja found work in a cached build (its log or a copied source changed)
            say(f"{what} rebuilt in {took:.0f} s (its cached build in {folder} was out of date)")
        return mod
    except Exception as e:  # noqa: BLE001 — any build failure means: the Python path
        msg = str(e).strip().splitlines()
        warnings.warn(f"fastgrpo: {what} could not be built ({type(e).__name__}: "
                      f"{msg[-1] if msg else ''}); {fallback} is used", RuntimeWarning, stacklevel=4)
        return None
