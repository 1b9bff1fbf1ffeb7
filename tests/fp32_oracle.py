"""The float32-vs-float64 check shared by the model and rollout tests (tests/models/model_oracle.py,
tests/rollout/rollout_oracle.py; importable from every test folder: pytest puts tests/, the
folder of the root conftest.py, on sys.path).

A float32 path is held to its float64 twin next to a float32 reference of the same math:
rms|got − truth| ≤ rms|ref − truth| + tol, with tol = U · depth · max|truth| (Higham's
worst-case n·u for sums of total length `depth`, in any order, blocked or fused: it holds on any
x86 CPU, whichever GEMM kernels and vector widths it takes).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

U = 2.0 ** -24  # float32 unit roundoff


def fp32_tol(depth: int, truth: torch.Tensor) -> float:
    """U · depth · max|truth| over the finite entries of `truth`."""
    t = truth.detach().double()
    t = t[torch.isfinite(t)]
    return U * depth * (float(t.abs().max()) if t.numel() else 0.0)


def _rms(e: torch.Tensor) -> float:
    return float(e.pow(2).mean().sqrt()) if e.numel() else 0.0


def check_fp32(name: str, got, ref, truth, tol: float, labels: Optional[Sequence] = None) -> None:
    """rms|got − truth| ≤ rms|ref − truth| + tol, and rms|ref − truth| ≤ tol (the reference is
    itself as accurate as float32 can be); `ref` None: rms|got − truth| ≤ tol. A NaN fails.
    On failure the worst elements are printed (named by `labels` where given)."""
    g = torch.as_tensor(got).detach().double().reshape(-1)
    t = torch.as_tensor(truth).detach().double().reshape(-1)
    assert g.shape == t.shape, f"{name}: shape {tuple(g.shape)} != truth {tuple(t.shape)}"
    r = None if ref is None else torch.as_tensor(ref).detach().double().reshape(-1)
    err_g = (g - t).abs()
    rms_g, rms_r = _rms(err_g), (0.0 if r is None else _rms(r - t))
    bound = rms_r + tol
    if not (rms_r <= tol and rms_g <= bound):
        worst = err_g.nan_to_num(float("inf")).topk(min(5, g.numel())).indices
        lines = [f"  [{labels[int(i)] if labels is not None else int(i)}] got={float(g[i]):.9g} truth={float(t[i]):.9g}"
                 + ("" if r is None else f" ref={float(r[i]):.9g}") + f" err={float(err_g[i]):.3g}" for i in worst]
        raise AssertionError(f"{name}: rms error {rms_g:.3g} (reference {rms_r:.3g}) against the bound "
                             f"{bound:.3g} (tol {tol:.3g}); worst:\n" + "\n".join(lines))
