"""Config choice for the fused GRPO kernels: per-device config tables, a deterministic tuner that
runs on a bounded scratch slice, an on-disk cache of its choices, and a runtime fallback when a
config fails to compile.

Why not `triton.autotune`: (1) its `restore_value` clones every output it protects before each
benchmarked config, so the in-place backward allocated a second N×V buffer on its first call
(~20 GB at 64k × 152k bf16); (2) its key held V and the pointer dtypes only, so the first call
(an N = 4096 check without entropy) fixed the config for every later call; (3) it re-tunes in
every process, so the first training step was a tuning step. Here the key is (kernel, device,
dtypes, constexpr flags, V bucket, layout, N bucket), tuning times each candidate on a scratch
slice of at most `TUNE_BYTES` of logits (outputs in fresh scratch, never the caller's buffer),
and the choice is written to a JSON file under the fastgrpo cache folder, so every later process
starts with it. Ties within `TIE_FRAC` go to the earlier (preferred) config: the choice does not
flip with timing noise.

Layouts ("a" aligned, "t" aligned rows with an odd V, "u" unaligned rows): Triton specialises an
integer argument divisible by 16 and vectorises loads only when the row stride is; the kernels
peel the vocabulary tail (an unmasked main loop + one masked block), so "t" keeps 128-bit loads.
"u" (row stride not a multiple of 16, e.g. a contiguous [N, 50257]) loads one element at a time;
there only tiles of at most `UNALIGNED_ELEMS_PER_THREAD` elements per thread are kept, since the
wide multi-row tiles then need 255 registers and spill (benchmarks/compile_grid.py measures it).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import threading
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import triton

from fastgrpo import env
from fastgrpo.kernels.triton import _common
from fastgrpo.kernels.triton._common import KernelConfig


def _cfgs(rows) -> Tuple[KernelConfig, ...]:
    return tuple(KernelConfig(bn, bv, w) for bn, bv, w in rows)


# Bandwidth-bound kernels: tiles of 4k–16k elements with enough warps to keep 16–32 elements per
# thread in flight; single-row tiles win at large V, multi-row tiles when V is small. Order is
# preference: ties go to the earlier config, and the first one is the untuned default.
# At most 32 elements per thread: the backward kernel needs ~4 registers per element, and the
# earlier 32×256 / 64×128 tiles on 4 warps (64 per thread) took 215–255 registers on sm_90 (8
# warps per SM) and spilled 624 B in fp32 (benchmarks/compile_grid.py); on 8 warps they take 128.
SM90 = _cfgs(((1, 4096, 8), (1, 8192, 16), (2, 4096, 8), (4, 2048, 8), (4, 4096, 16),
              (8, 1024, 8), (8, 2048, 16), (16, 512, 8), (32, 256, 8), (64, 128, 8)))
# Other GPUs (sm_80 and older): smaller tiles, all on 8 warps (on 4 the backward's 4×1024,
# 16×256 and 64×64 tiles took 159–168 registers on sm_80: 12 warps per SM).
FALLBACK = _cfgs(((1, 4096, 8), (2, 2048, 8), (4, 1024, 8), (16, 256, 8), (64, 64, 8)))
UNALIGNED_ELEMS_PER_THREAD = 16
# ... and at most 2 rows: unaligned multi-row tiles compute a 64-bit address per element; in
# fp32 the 8–64-row ones spilled 48–640 B on sm_90, on sm_80 the 64×64 one took 255 registers.
UNALIGNED_MAX_ROWS = 2
# (elem bytes, config) pairs that still spill after the warp scaling (compile grid, sm_90):
# fp32 32×256 on 16 warps is held to 64 registers and spills 8 B in the forward.
_SPILLS = {(4, KernelConfig(32, 256, 16))}
# Logits bytes per thread per block: 64 B (32 bf16) took ≤ 128 registers in the backward on
# sm_90; 32 fp32 per thread (128 B) took 229 (8 warps per SM). Wider dtypes get more warps.
MAX_BYTES_PER_THREAD = 64
# Kernels whose per-element work is heavier get their tiles sized as for fp32 logits (at most 16
# elements per thread) even for bf16 / fp16: the soft-capped backward (a tanh and its derivative
# per element) took 151–152 registers (8 warps per SM) or spilled 8–32 B on the bf16 multi-row
# tiles of 32 elements per thread on sm_90, and took ≤ 128 with no spill on the fp32 ones (the
# capped forward needs no such care: every bf16 / fp16 table config compiles unspilled).
HEAVY_MIN_ELEM_BYTES = 4
TUNE_BYTES = 256 << 20  # scratch logits slice the tuner reads (and, for the backward, writes)
TIE_FRAC = 0.03
_N_BUCKETS = (256, 2048, 16384)


def device_configs(capability_major: int) -> Tuple[KernelConfig, ...]:
    return SM90 if capability_major >= 9 else FALLBACK


def configs_for(configs: Sequence[KernelConfig], elem_bytes: int) -> Tuple[KernelConfig, ...]:
    """The table for a logits dtype: warps doubled (up to 16) until a thread holds at most
    MAX_BYTES_PER_THREAD of logits per block; configs still above it are dropped (unless none is left)."""
    out = []
    for c in configs:
        w = c.num_warps
        while c.block_n * c.block_v * elem_bytes > MAX_BYTES_PER_THREAD * 32 * w and w < 16:
            w *= 2
        out.append(dataclasses.replace(c, num_warps=w))
    fit = [c for c in out if c.block_n * c.block_v * elem_bytes <= MAX_BYTES_PER_THREAD * 32 * c.num_warps
           and (elem_bytes, c) not in _SPILLS]
    return tuple(dict.fromkeys(fit or out))


def layout_of(n_cols: int, strides: Sequence[int]) -> str:
    if any(s % 16 for s in strides):
        return "u"
    return "a" if n_cols % 16 == 0 else "t"


def candidates(configs: Sequence[KernelConfig], n_cols: int, layout: str) -> List[KernelConfig]:
    """Configs worth trying for V = n_cols: no block far wider than the vocabulary (pure
    padding), and on unaligned rows only tiles with few elements per thread. Never empty."""
    pool = list(configs)
    if layout == "u":
        pool = [c for c in pool if c.elems_per_thread() <= UNALIGNED_ELEMS_PER_THREAD
                and c.block_n <= UNALIGNED_MAX_ROWS] or pool
    cap = max(triton.next_power_of_2(max(n_cols, 1)), 128)
    kept = [c for c in pool if c.block_v <= cap]
    return kept or [min(pool, key=lambda c: (c.block_v, c.elems_per_thread()))]


def n_bucket(n_rows: int) -> int:
    return next((i for i, b in enumerate(_N_BUCKETS) if n_rows <= b), len(_N_BUCKETS))


def cache_path() -> str:
    """The tuning cache: a JSON file next to fastgrpo's JIT builds (~/.cache/fastgrpo/tune/ by
    default, the sibling of FASTGRPO_EXT_DIR when that is set), one file per Triton version."""
    root = os.path.join(os.path.dirname(os.path.abspath(env.ext_dir())), "tune")
    return os.path.join(root, f"triton-{triton.__version__}.json")


def _compile_errors():
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    return (CompilationError, OutOfResources, PTXASError)


def _bench(fn: Callable[[], None]) -> float:
    # short and median: the kernels run for micro- to milliseconds and the ranking, not the
    # figure, matters; TIE_FRAC absorbs the remaining noise
    return float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))


class TunedKernel:
    """A `@triton.jit` kernel with BLOCK_N / BLOCK_V / num_warps / num_stages chosen per key.

    `launch(grid, args, consts, n_rows, n_cols, strides, scratch)`: `scratch(rows)` returns the
    positional args of the same launch on `rows` rows, with every output freshly allocated (the
    tuner times on them: the caller's outputs are never written before the real launch).
    `bench` and `device_key` are injectable for tests. `heavy_flag`: a constexpr (e.g.
    "HAS_SOFTCAP") that, when set, sizes the tiles as for fp32 logits (`HEAVY_MIN_ELEM_BYTES`)."""

    def __init__(self, kernel, name: str, bench: Callable = _bench,
                 device_key: Optional[Callable[[], Tuple[str, int]]] = None, heavy_flag: Optional[str] = None):
        self.kernel = kernel
        self.name = name
        self.heavy_flag = heavy_flag
        self.bench = bench
        self.device_key = device_key or _cuda_device_key
        self.chosen: Dict[str, KernelConfig] = {}
        self.broken: set = set()  # (key, config) pairs that failed to compile or launch
        self._lock = threading.Lock()

    def key(self, args, consts: Dict, n_rows: int, n_cols: int, layout: str) -> str:
        dev, _ = self.device_key()
        dtypes = ",".join(str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor))
        flags = ",".join(f"{k}={int(v)}" for k, v in sorted(consts.items()))
        v_bucket = triton.next_power_of_2(max(n_cols, 1))
        return f"{self.name}|{dev}|{dtypes}|{flags}|V{v_bucket}|{layout}|N{n_bucket(n_rows)}"

    def _run(self, grid, rows: int, args, consts, cfg: KernelConfig):
        self.kernel[grid(cfg, rows)](*args, **consts, BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v,
                               num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def tune(self, key: str, grid, consts, cands: List[KernelConfig], n_rows: int, row_bytes: int,
             scratch: Callable[[int], tuple]) -> KernelConfig:
        rows = int(max(1, min(n_rows, TUNE_BYTES // max(row_bytes, 1))))
        s_args = scratch(rows)
        timed = []
        for cfg in cands:
            try:
                self._run(grid, rows, s_args, consts, cfg)  # compile + warm
                timed.append((self.bench(lambda: self._run(grid, rows, s_args, consts, cfg)), cfg))
            except _compile_errors() as e:
                self.broken.add((key, cfg))
                warnings.warn(f"fastgrpo: {self.name} config {cfg.as_tuple()} failed to compile "
                              f"({type(e).__name__}: {str(e)[:200]}); trying the next one", RuntimeWarning)
        if not timed:
            return cands[0]
        best = min(t for t, _ in timed)
        return next(cfg for t, cfg in timed if t <= best * (1 + TIE_FRAC))

    def launch(self, grid: Callable[[KernelConfig, int], tuple], args: tuple, consts: Dict, n_rows: int,
               n_cols: int, strides: Sequence[int], row_bytes: int, scratch: Callable[[int], tuple]) -> KernelConfig:
        if _common.INTERPRET:  # read at each launch: tests switch it
            cfg = _common.interp_config(n_rows, n_cols)
            self._run(grid, n_rows, args, consts, cfg)
            return cfg
        layout = layout_of(n_cols, strides)
        key = self.key(args, consts, n_rows, n_cols, layout)
        elem = args[0].element_size()
        if self.heavy_flag and consts.get(self.heavy_flag):
            elem = max(elem, HEAVY_MIN_ELEM_BYTES)
        cands = candidates(configs_for(device_configs(self.device_key()[1]), elem), n_cols, layout)
        with self._lock:
            cfg = self.chosen.get(key) or _disk_get(key)
            if cfg is None or cfg not in cands:
                cfg = self.tune(key, grid, consts, cands, n_rows, row_bytes, scratch)
                _disk_put(key, cfg)
            self.chosen[key] = cfg
        order = [cfg] + [c for c in cands if c != cfg]
        for i, c in enumerate(order):
            if (key, c) in self.broken and i + 1 < len(order):
                continue
            try:
                self._run(grid, n_rows, args, consts, c)
                if c != cfg:
                    self.chosen[key] = c
                return c
            except _compile_errors() as e:
                self.broken.add((key, c))
                if i + 1 == len(order):
                    raise
                warnings.warn(f"fastgrpo: {self.name} config {c.as_tuple()} failed at run time "
                              f"({type(e).__name__}: {str(e)[:200]}); falling back to {order[i + 1].as_tuple()}",
                              RuntimeWarning)
        raise AssertionError("unreachable")

    def warmup(self, *launch_args, **launch_kwargs) -> KernelConfig:
        """Same as `launch` (tunes, caches and compiles the chosen config): the GPU suite's
        warm-up step calls the real launchers once per shape it will time."""
        return self.launch(*launch_args, **launch_kwargs)


@functools.lru_cache(maxsize=None)
def _cuda_device_key() -> Tuple[str, int]:
    """(device name with capability, capability major): asked at the first launch, not at import."""
    if not torch.cuda.is_available():
        return ("cpu", 0)
    major, minor = torch.cuda.get_device_capability()
    return (f"{torch.cuda.get_device_name()}@sm{major}{minor}", major)


_disk: Optional[Dict[str, list]] = None
_disk_file: Optional[str] = None


def _disk_load() -> Dict[str, list]:
    global _disk, _disk_file
    path = cache_path()
    if _disk is None or _disk_file != path:
        _disk_file = path
        try:
            with open(path) as f:
                _disk = dict(json.load(f))
        except (OSError, ValueError):
            _disk = {}
    return _disk


def _disk_get(key: str) -> Optional[KernelConfig]:
    raw = _disk_load().get(key)
    try:
        return KernelConfig(*map(int, raw)) if raw else None
    except TypeError:
        return None


def _disk_put(key: str, cfg: KernelConfig) -> None:
    """Merge into the JSON file (another process may have added keys) and replace it atomically."""
    data = _disk_load()
    data[key] = list(cfg.as_tuple())
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path) as f:
                data.update({k: v for k, v in json.load(f).items() if k not in data})
        except (OSError, ValueError):
            pass
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tune-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home must not stop training: the choice stays in memory
        warnings.warn(f"fastgrpo: could not write the tuning cache {path}: {e}", RuntimeWarning)
