"""Shared benchmark harness: timing (median / p20 / p80 of several repeats), peak memory of a
case measured in a fresh subprocess, a printed table, and CSV rows appended to
benchmarks/results/<name>.csv with the git sha and the device.

Usage in a benchmark script:

    from benchmarks.harness import Bench, time_fn
    bench = Bench("loss")
    stats = time_fn(lambda: f(x), repeats=7, warmup=2)
    bench.add(case="torch fwd+bwd", shape="N=4096,V=151936", stats=stats, peak_mb=..., extra={...})
    bench.finish()   # prints the table, appends the CSV

Peak memory: `peak_rss_subprocess(module, func, kwargs)` runs `module.func(**kwargs)` in a new
Python process and returns (its peak RSS − the RSS right before the call) in MiB, so that each
case starts from a clean allocator and one case's cache does not hide another's peak.
"""
from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def git_sha() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).decode().strip()
    except Exception:
        return "unknown"


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()}"


@dataclass
class Stats:
    median_s: float
    p20_s: float
    p80_s: float
    samples: List[float]


def _quantile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_interleaved(fns: Dict[str, Callable[[], object]], repeats: int = 30, warmup: int = 3) -> Dict[str, Stats]:
    """{name: Stats} of several callables run in turn inside each repeat, so that they see the
    same machine load (the side-by-side ratios the project reports)."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    out: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            out[k].append(time.perf_counter() - t0)
    return {k: Stats(statistics.median(v), _quantile(v, 0.2), _quantile(v, 0.8), v) for k, v in out.items()}


def time_fn(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, sync: Optional[Callable] = None) -> Stats:
    """Wall-clock seconds of fn() over `repeats` runs after `warmup` runs (medians, not means:
    the machines are noisy). `sync` (e.g. torch.cuda.synchronize) is called around each run."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        samples.append(time.perf_counter() - t0)
    return Stats(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8), samples)


_CHILD = r"""
import importlib, json, os, sys, psutil
proc = psutil.Process()
def anon():
    # RSS minus file-backed pages: library code evicted and re-read under memory pressure would
    # otherwise count as the measured call's allocation.
    m = proc.memory_info()
    return m.rss - m.shared
mod = importlib.import_module(sys.argv[1])
func = getattr(mod, sys.argv[2])
kwargs = json.loads(sys.argv[3])
prep = func(prepare=True, **kwargs)          # allocate inputs; not counted
import gc; gc.collect()
base = anon()
peak = {"v": base}
import threading, time
stop = False
def poll():
    while not stop:
        peak["v"] = max(peak["v"], anon())
        time.sleep(0.002)
t = threading.Thread(target=poll, daemon=True); t.start()
func(prepared=prep, **kwargs)
stop = True; t.join()
peak["v"] = max(peak["v"], anon())
print("PEAK_MB", (peak["v"] - base) / 2**20)
"""


def peak_rss_subprocess(module: str, func: str, kwargs: Dict, timeout: float = 600) -> float:
    """Extra peak RSS (MiB) of `module.func(prepared=..., **kwargs)` in a fresh process.

    `func(prepare=True, **kwargs)` must return the prepared inputs (not counted) and
    `func(prepared=p, **kwargs)` must run the measured work once.
    Memory is anonymous RSS (rss − shared), polled every 2 ms; ru_maxrss is not used because it
    is a lifetime high-water mark that would count the input preparation.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _CHILD, module, func, json.dumps(kwargs)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("PEAK_MB"):
            return float(line.split()[1])
    raise RuntimeError(f"peak-memory child failed for {module}.{func}({kwargs}):\n{out.stderr[-2000:]}")


@dataclass
class Bench:
    name: str
    rows: List[Dict] = field(default_factory=list)

    def add(self, case: str, shape: str, stats: Optional[Stats] = None, peak_mb: Optional[float] = None,
            extra: Optional[Dict] = None):
        row = {
            "bench": self.name,
            "case": case,
            "shape": shape,
            "median_ms": round(stats.median_s * 1e3, 3) if stats else "",
            "p20_ms": round(stats.p20_s * 1e3, 3) if stats else "",
            "p80_ms": round(stats.p80_s * 1e3, 3) if stats else "",
            "peak_mb": round(peak_mb, 1) if peak_mb is not None else "",
        }
        for k, v in (extra or {}).items():
            row[k] = round(v, 4) if isinstance(v, float) else v
        self.rows.append(row)
        return row

    def table(self) -> str:
        if not self.rows:
            return "(no rows)"
        cols: List[str] = []
        for r in self.rows:
            for k in r:
                if k not in cols and k != "bench":
                    cols.append(k)
        widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in self.rows)) for c in cols}
        lines = ["| " + " | ".join(c.ljust(widths[c]) for c in cols) + " |",
                 "|" + "|".join("-" * (widths[c] + 2) for c in cols) + "|"]
        for r in self.rows:
            lines.append("| " + " | ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) + " |")
        return "\n".join(lines)

    def finish(self, csv_path: Optional[str] = None) -> str:
        text = self.table()
        print(f"\n## {self.name}  (git {git_sha()}, {device_name()})\n{text}\n")
        os.makedirs(RESULTS_DIR, exist_ok=True)
        path = csv_path or os.path.join(RESULTS_DIR, f"{self.name}.csv")
        sha, dev, ts = git_sha(), device_name(), time.strftime("%Y-%m-%dT%H:%M:%S")
        keys: List[str] = ["time", "git_sha", "device"]
        for r in self.rows:
            for k in r:
                if k not in keys:
                    keys.append(k)
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            if new:
                w.writeheader()
            for r in self.rows:
                w.writerow({"time": ts, "git_sha": sha, "device": dev, **r})
        return text
