"""Shared Triton pieces of the fused GRPO kernels: the online log-sum-exp / entropy update over
one vocabulary block of a row tile, the logit soft cap (Gemma 2/3's final_logit_softcapping) and
its derivative, and the autotune set-up shared by every kernel.

Soft cap: c = cap·tanh(z/cap) with tanh from one exp and one division, e = exp(−2|z|/cap),
r = 2/(1 + e), tanh = ±(r − 1), and ∂c/∂z = e·r² (= 1 − tanh², without the cancellation of
1 − t² where t rounds to ±1). Triton's core language has no tanh and libdevice's does not run
under the interpreter; the absolute error of r − 1 is a few ulp of 1, so c is off by a few ulp of
the cap, which is the size of the rounding of a capped logit near ±cap anyway.

Online softmax follows Milakov & Gimelshein (2018) as used by Liger-Kernel and Apple's Cut
Cross-Entropy; the entropy rides along as a second running sum. Departure from Liger: every
program owns a 2-D tile of BLOCK_N rows × BLOCK_V columns (Liger: one row per program), and the
grid has one axis over row tiles, so N up to 2^31·BLOCK_N rows works (Liger's kernels index a
second grid axis that stops at 65 535).

Config choice: on a GPU `_tune.TunedKernel` picks among configs for Hopper (capability 9.x) or
a smaller fallback set elsewhere, once per key, cached on disk. Under TRITON_INTERPRET=1 (CPU
tests) a single shape-derived config is used, so nothing is benchmarked: the interpreter's cost
grows with the number of programs, so that config takes many rows per program. `KernelConfig`
and that interpreter config live here and `_tune` imports them: the import goes one way only.
"""
from __future__ import annotations

import dataclasses
import struct
from typing import Tuple

import torch
import triton
import triton.language as tl

from fastgrpo import env

INTERPRET = env.triton_interpret()

# Largest tile (elements) the interpreter config uses: numpy handles 16k-element tiles in
# microseconds, while each extra program costs a Python-level launch of every op.
_INTERP_TILE = 16384


# The launch config of a row-tiled kernel, chosen by `_tune` (its tables and tuner) or by
# `interp_config` below; defined here so that `_tune` imports `_common` and never the reverse.
@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_n: int  # rows per program
    block_v: int  # vocabulary columns per step
    num_warps: int
    # 1: the kernels issue no async copies (no tl.dot, no descriptor loads), so num_stages = 2
    # compiled to the same SASS (checked by benchmarks/compile_grid.py) and only doubled the list.
    num_stages: int = 1

    def elems_per_thread(self) -> int:
        return self.block_n * self.block_v // (32 * self.num_warps)

    def as_tuple(self) -> Tuple[int, int, int, int]:
        return (self.block_n, self.block_v, self.num_warps, self.num_stages)


@triton.jit
def online_lse_update(x, m, s, t, HAS_ENT: tl.constexpr):
    """One vocabulary block of the online log-sum-exp with entropy, in the accumulation dtype.

    x: [BN, BV] scaled logits z/τ (−inf on padding columns); m: [BN] running max;
    s: [BN] Σ e^(x−m); t: [BN] Σ e^(x−m)·(x−m). Keeping t relative to the running max avoids
    the cancellation of lse − E[x] when logits are large. Returns the new (m, s, t);
    at the end lse = m + log s and H = log s − t/s. Without HAS_ENT, t is left untouched
    (three fewer ALU ops per element in the log-probs-only pass).
    """
    m_new = tl.maximum(m, tl.max(x, 1))
    # A row whose logits so far are all −inf (a masked vocabulary block first) keeps s = 0:
    # shifting by 0 instead of −inf gives p = 0 rather than NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    d = x - m_ref[:, None]
    p = tl.exp(d)
    # While s = 0 (nothing seen yet) the rescale terms are 0; the select avoids −inf·0 = NaN.
    alpha = tl.where(s > 0, tl.exp(m - m_ref), 0.0)
    s_new = alpha * s + tl.sum(p, 1)
    t_new = t
    if HAS_ENT:
        # p = 0 on padding columns and on −inf logits (probability 0, 0·log 0 = 0): skip p·d = 0·(−inf).
        shift = tl.where(s > 0, m - m_ref, 0.0)
        t_new = alpha * (t + shift * s) + tl.sum(tl.where(p > 0, p * d, 0.0), 1)
    return m_new, s_new, t_new


@triton.jit
def softcap_grad(x, cap, inv_cap):
    """(cap·tanh(x/cap), ∂/∂x = 1 − tanh²(x/cap)) elementwise, in the dtype of x (see the module
    docstring). x = −inf gives (−cap, 0): a caller that pads with −inf re-masks afterwards."""
    e = tl.exp(-2.0 * tl.abs(x) * inv_cap)
    r = 2.0 / (1.0 + e)  # tanh|y| = r − 1 and 1 − tanh² = e·r²: one division, few live values
    c = tl.where(x < 0, 1.0 - r, r - 1.0) * cap
    return c, e * r * r


@triton.jit
def apply_softcap(x, cap, inv_cap):
    """cap·tanh(x/cap) elementwise (the forward half of `softcap_grad`)."""
    c, _ = softcap_grad(x, cap, inv_cap)
    return c


@triton.jit
def load_cap(cap, cap_lo, FP64: tl.constexpr):
    """(cap, 1/cap) in the accumulation dtype: the fp32 pair (hi, lo) joined in fp64, as load_scale."""
    c = cap
    if FP64:
        c = tl.cast(cap, tl.float64) + tl.cast(cap_lo, tl.float64)
    return c, 1.0 / c


@triton.jit
def grad_block(x, cols, lse, g, h, ent, tgt, HAS_H: tl.constexpr):
    """g·(δ_{j,y} − p_j) − h·p_j·(log p_j + H) on one [BN, BV] block of scaled logits x = z/τ
    (g and h already carry the 1/τ)."""
    logq = x - lse[:, None]
    p = tl.exp(logq)
    grad = -g[:, None] * p
    if HAS_H:
        grad -= h[:, None] * p * (logq + ent[:, None])
    return tl.where(cols[None, :] == tgt[:, None], grad + g[:, None], grad)


@triton.jit
def capped_grad_block(x, cols, lse, g, h, ent, tgt, g_dc_tgt, scale, cap, inv_cap, HAS_H: tl.constexpr):
    """`grad_block` for soft-capped logits, on one [BN, BV] block of raw logits x:
    ∂c/∂z·(g·(δ_{j,y} − p_j) − h·p_j·(log p_j + H)) with c = cap·tanh(x/cap), log p = c·scale − lse.
    ∂c/∂z is folded into p at once and the target's share comes as the per-row g_dc_tgt = g·∂c/∂z
    at y, so no per-element factor stays live across the block: `grad_block(…) * dc` took 142–162
    registers per thread on sm_90 (16 warps/SM → 8) where this form keeps the uncapped count."""
    c, dc = softcap_grad(x, cap, inv_cap)
    logq = c * scale - lse[:, None]
    pd = tl.exp(logq) * dc
    grad = -g[:, None] * pd
    if HAS_H:
        grad -= h[:, None] * pd * (logq + ent[:, None])
    return tl.where(cols[None, :] == tgt[:, None], grad + g_dc_tgt[:, None], grad)


@triton.jit
def row_tile(pid, n_rows, BLOCK_N: tl.constexpr):
    """Row indices of a tile, the in-range mask, and rows clamped to N−1 for loads (so padding
    rows of the last tile read real data and never produce NaNs)."""
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    rows_c = tl.minimum(rows, n_rows - 1)
    return rows, row_ok, rows_c


def interp_config(n_rows: int, n_cols: int):
    """The one config used under the interpreter: the whole (small) vocabulary in one block when
    it fits, and as many rows as fill `_INTERP_TILE` elements."""
    bv = min(triton.next_power_of_2(max(n_cols, 1)), 2048)
    bn = max(1, min(triton.next_power_of_2(max(n_rows, 1)), _INTERP_TILE // bv, 1024))
    return KernelConfig(bn, bv, 4, 1)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def split_inv_temp(temperature: float):
    """1/τ as an fp32 pair (hi, lo) with hi + lo = 1/τ to ~2^-48: compiled Triton passes Python
    floats as fp32, which would cap the fp64 (oracle-grade) path at fp32 accuracy for τ ≠ 1."""
    inv = 1.0 / float(temperature)
    if not inv < 3.0e38:
        raise ValueError(f"temperature={temperature!r}: 1/τ must fit in float32 (τ > 3.4e-39) for the Triton kernels")
    hi = _f32(inv)
    return hi, _f32(inv - hi)


def split_softcap(softcap):
    """(HAS_SOFTCAP, cap hi, cap lo): the soft cap as the fp32 pair the kernels take (1.0, 0.0
    when off, never read then), split as `split_inv_temp` for the fp64 path."""
    if softcap is None:
        return False, 1.0, 0.0
    cap = float(softcap)
    if not 1.2e-38 < cap < 3.0e38:
        raise ValueError(f"softcap={softcap!r}: the cap must be a normal float32 (1.2e-38 < cap < 3e38) for the "
                         "Triton kernels")
    hi = _f32(cap)
    return True, hi, _f32(cap - hi)


@triton.jit
def load_scale(inv_temp, inv_temp_lo, FP64: tl.constexpr):
    """The 1/τ the kernels multiply by: fp32 hi part, or hi + lo in fp64."""
    scale = inv_temp
    if FP64:
        scale = tl.cast(inv_temp, tl.float64) + tl.cast(inv_temp_lo, tl.float64)
    return scale


def grid_rows(cfg, n_rows: int):
    """1-D grid over row tiles: axis 0 takes up to 2^31−1 programs (axes 1/2 stop at 65 535)."""
    return (triton.cdiv(n_rows, cfg.block_n),)


def row_major_logits(logits: torch.Tensor, name: str = "logits") -> torch.Tensor:
    """Kernels take any row stride but need unit column stride; anything else (e.g. a transposed
    view) is copied once into a contiguous tensor — documented cost of O(N·V) bytes."""
    if logits.dim() != 2:
        raise ValueError(f"{name}: expected shape [N, V], got {tuple(logits.shape)}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        return logits.contiguous()
    return logits
