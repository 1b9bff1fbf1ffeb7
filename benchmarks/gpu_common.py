"""Shared pieces of the GPU benchmarks (bench_gpu_kernels.py, bench_gpu_fused_linear.py):
importing fastgrpo from a bare checkout, timing with triton.testing.do_bench (harness.time_fn
on CPU), peak CUDA memory, measured copy bandwidth, an oracle check and the optional
competitors (Liger-Kernel, TRL), each detected and skipped when not importable.

`--cpu-smoke` mode runs every code path on CPU under TRITON_INTERPRET=1 at tiny sizes, so that
the scripts are exercised in CI before their first real use on a GPU.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bootstrap(cpu_smoke: bool) -> None:
    """Make `fastgrpo` and `fastgrpo.kernels` importable from the checkout even when the package
    is not pip-installed (the device machine gets a bare copy of the working tree). setup.py maps
    kernels/ to fastgrpo.kernels; the same mapping is done here by a module spec."""
    if cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import fastgrpo

    try:
        importlib.import_module("fastgrpo.kernels")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "fastgrpo.kernels", os.path.join(ROOT, "kernels", "__init__.py"),
            submodule_search_locations=[os.path.join(ROOT, "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["fastgrpo.kernels"] = mod
        spec.loader.exec_module(mod)
        fastgrpo.kernels = mod


def bench_ms(fn: Callable[[], object], device, grad_to_none=None):
    """harness.Stats of fn (seconds): do_bench median / p20 / p80 on CUDA (L2 flushed between
    runs, many repeats), harness.time_fn (5 repeats) on CPU."""
    from benchmarks.harness import Stats, time_fn

    if device.type == "cuda":
        import triton.testing

        def run():
            if grad_to_none:
                for t in grad_to_none:
                    t.grad = None
            fn()

        med, p20, p80 = triton.testing.do_bench(run, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
        return Stats(med / 1e3, p20 / 1e3, p80 / 1e3, [])

    def run_cpu():
        for t in grad_to_none or ():
            t.grad = None
        fn()

    return time_fn(run_cpu, repeats=5, warmup=1)


def peak_mb(fn: Callable[[], object], device, grad_to_none=None) -> Optional[float]:
    """Extra peak CUDA memory (MiB) of one call above what was allocated before it."""
    import torch

    if device.type != "cuda":
        return None
    for t in grad_to_none or ():
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def copy_bandwidth_gbs(device, nbytes: int = 2 ** 30) -> float:
    """Measured device copy bandwidth (GB/s): a copy reads and writes nbytes each."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    stats = bench_ms(lambda: dst.copy_(src), device)
    del src, dst
    return 2 * nbytes / stats.median_s / 1e9


def oracle_check(name: str, kernel, ref, truth, atol: float, rtol: float) -> str:
    """Same bound as the tests: |kernel − truth| ≤ max|ref − truth| + atol + rtol·|truth|.
    Returns a one-line verdict; raises AssertionError with the worst index on failure."""
    k, r, t = (x.detach().double().reshape(-1) for x in (kernel, ref, truth))
    err = (k - t).abs()
    ref_err = (r - t).abs()
    ref_max = float(ref_err[ref_err.isfinite()].max()) if bool(ref_err.isfinite().any()) else 0.0
    bound = ref_max + atol + rtol * t.abs()
    bad = ~(err <= bound)
    if bool(bad.any()):
        i = int(((err - bound).nan_to_num(float("inf"))).argmax())
        raise AssertionError(f"{name}: {int(bad.sum())}/{k.numel()} beyond bound; worst [{i}] kernel={float(k[i])} "
                             f"truth={float(t[i])} ref={float(r[i])} bound={float(bound[i])}")
    return f"{name}: ok (max err {float(err.max()):.3g}, same-dtype reference {ref_max:.3g})"


def try_import(module: str, attr: str):
    """The competitor's callable, or None (with the reason printed) when it cannot be imported."""
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # an absent or broken optional competitor must not stop the suite
        print(f"[skip] {module}.{attr}: {type(e).__name__}: {e}")
        return None


def parse_sizes(text: str):
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * mult))
    return out


def sequence_layout(n: int, g, device, seq_len: int) -> dict:
    """The packed-batch layout shared by the GPU benches: N tokens as b = N // t sequences of
    t = min(seq_len, N) (the remainder joins the last one's advantage), one advantage per
    sequence broadcast to its tokens, ~90 % of tokens on the loss mask, and cu_seqlens.
    Drawn from generator `g` on `device` in a fixed order (adv_seq, then mask)."""
    import torch

    t = min(seq_len, n)
    b = n // t
    adv_seq = torch.randn(b, generator=g, device=device)
    adv = torch.cat([adv_seq.repeat_interleave(t), adv_seq[-1:].expand(n - b * t)])
    mask = (torch.rand(n, generator=g, device=device) > 0.1).float()
    cu = torch.cat([torch.arange(0, n, t), torch.tensor([n])])
    return dict(adv=adv, adv_seq=adv_seq, mask=mask, cu=cu, b=b, t=t)
