"""Single-kernel fused lm_head + log-probs (Cut Cross-Entropy style): the matmul tile
hidden[rows] · weight[cols]ᵀ and the online log-sum-exp in one Triton kernel, so no logits
tile ever reaches memory; the backward recomputes each tile and turns it straight into its
shares of dH and dW.

Follows Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (Apple, 2024):
forward = one program per row tile looping over the vocabulary (tl.dot over hidden chunks, then
the online log-sum-exp / entropy update of `_common.online_lse_update`, the target logit picked
from its tile); backward = one program per (row tile, vocabulary tile): recompute the tile, make
dZ = g·(δ_y − p)/τ − h·p·(log p + H)/τ (`_common.grad_block`), then dH[rows] += dZ·W[cols]
and dW[cols] += dZᵀ·H[rows] with fp32 atomics. Departures from CCE: no gradient filtering (CCE
skips vocabulary tiles whose p is below bf16 resolution), no vocabulary sorting, and tiles whose
rows all have g = h = 0 (prompt / masked tokens) return at once. Backend "cce" of
`fused_linear.fused_linear_fwd`; the O(N) objective between the two kernels is the chunked
path's. bf16 / fp16 / fp32 (fp32 dots in IEEE precision, as torch.mm); fp64 is refused.
A soft cap (`HAS_SOFTCAP`, Gemma 2/3's final_logit_softcapping) is applied to the fp32 logits
tile in registers (`_common.softcap_grad`), and the backward's dZ carries ∂c/∂z = 1 − tanh²(z/cap).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fastgrpo.kernels.triton._common import (
    INTERPRET, apply_softcap, grad_block, online_lse_update, row_tile, softcap_grad, split_inv_temp, split_softcap)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
UPCAST_HALF = tl.constexpr(bool(INTERPRET))


@triton.jit
def _dot(a, b, acc):
    """acc + a·b: fp32 operands in IEEE precision (as torch.mm, no TF32), half ones as they are
    (under the interpreter upcast first: its bf16 dot is wrong; bf16·bf16 products are exact in
    fp32, so the result is the tensor-core one)."""
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    elif UPCAST_HALF:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows_c, cols_c, stride_hn, stride_wv, n_hidden,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """hidden[rows_c] · weight[cols_c]ᵀ (+ bias) as an fp32 [BLOCK_N, BLOCK_V] tile in registers."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for k0 in range(0, n_hidden, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < n_hidden
        a = tl.load(h_ptr + rows_c[:, None] * stride_hn + ks[None, :], mask=k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols_c[None, :] * stride_wv + ks[:, None], mask=k_ok[:, None], other=0.0)
        acc = _dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols_c).to(tl.float32)[None, :]
    return acc


@triton.jit
def _cce_fwd_kernel(
    h_ptr,  # [N, H] hidden states, row stride stride_hn, unit column stride
    w_ptr,  # [V, H] lm_head weight, row stride stride_wv, unit column stride
    b_ptr,  # [V] bias (read when HAS_BIAS)
    targets_ptr,  # [N] int target ids
    logp_ptr,  # [N] out: z[y]/τ − lse
    lse_ptr,  # [N] out: logsumexp(z/τ)
    ent_ptr,  # [N] out: entropy of softmax(z/τ) (written when HAS_ENT)
    stride_hn,  # row stride of hidden, in elements
    stride_wv,  # row stride of weight, in elements
    n_rows,  # N
    n_cols,  # V
    n_hidden,  # H
    inv_temp,  # 1/τ, runtime: a new temperature does not recompile
    softcap,  # soft cap, runtime: a new cap does not recompile; read when HAS_SOFTCAP
    HAS_BIAS: tl.constexpr,  # add the bias
    HAS_ENT: tl.constexpr,  # write the entropy
    HAS_SOFTCAP: tl.constexpr,  # cap the logits: z ← softcap·tanh(z/softcap) before 1/τ
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_V: tl.constexpr,  # vocabulary columns per tile
    BLOCK_H: tl.constexpr,  # hidden columns per dot step
):
    pid = tl.program_id(0)
    rows, row_ok, rows_c = row_tile(pid, n_rows, BLOCK_N)
    tgt = tl.load(targets_ptr + rows_c).to(tl.int64)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    xt = tl.zeros([BLOCK_N], tl.float32)
    for v0 in range(0, n_cols, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < n_cols
        x = _logits_tile(h_ptr, w_ptr, b_ptr, rows_c, tl.minimum(cols, n_cols - 1), stride_hn, stride_wv, n_hidden,
                         HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_H)
        if HAS_SOFTCAP:
            x = apply_softcap(x, softcap, 1.0 / softcap)
        x = x * inv_temp
        xt += tl.sum(tl.where(cols[None, :] == tgt[:, None], x, 0.0), 1)
        x = tl.where(col_ok[None, :], x, float("-inf"))
        m, s, t = online_lse_update(x, m, s, t, HAS_ENT)
    lse = m + tl.log(s)
    tl.store(logp_ptr + rows, xt - lse, mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    if HAS_ENT:
        tl.store(ent_ptr + rows, tl.log(s) - t / s, mask=row_ok)


@triton.jit
def _cce_bwd_kernel(
    h_ptr,  # [N, H] hidden states
    w_ptr,  # [V, H] lm_head weight
    b_ptr,  # [V] bias (read when HAS_BIAS)
    targets_ptr,  # [N] int target ids
    lse_ptr,  # [N] logsumexp(z/τ) from the forward kernel
    g_ptr,  # [N] ∂loss/∂logp_t
    hh_ptr,  # [N] ∂loss/∂H_t (read when HAS_H)
    ent_ptr,  # [N] H_t (read when HAS_H)
    dh_ptr,  # [N, H] fp32 out, accumulated with atomics: ∂loss/∂hidden (when HAS_DH)
    dw_ptr,  # [V, H] fp32 out, accumulated with atomics: ∂loss/∂weight (when HAS_DW)
    db_ptr,  # [V] fp32 out, accumulated with atomics: ∂loss/∂bias (when HAS_DB)
    stride_hn,  # row stride of hidden
    stride_wv,  # row stride of weight
    stride_dhn,  # row stride of dh
    stride_dwv,  # row stride of dw
    n_rows,  # N
    n_cols,  # V
    n_hidden,  # H
    inv_temp,  # 1/τ
    softcap,  # soft cap (read when HAS_SOFTCAP)
    HAS_BIAS: tl.constexpr,  # the logits have a bias
    HAS_H: tl.constexpr,  # entropy term present
    HAS_SOFTCAP: tl.constexpr,  # the forward capped the logits: dZ times 1 − tanh²(z/softcap)
    HAS_DH: tl.constexpr,  # write dH
    HAS_DW: tl.constexpr,  # write dW
    HAS_DB: tl.constexpr,  # write db
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_V: tl.constexpr,  # vocabulary columns per program
    BLOCK_H: tl.constexpr,  # hidden columns per dot step
):
    rows, row_ok, rows_c = row_tile(tl.program_id(0), n_rows, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < n_cols
    cols_c = tl.minimum(cols, n_cols - 1)
    g = tl.load(g_ptr + rows_c).to(tl.float32) * inv_temp
    h = g
    ent = g
    if HAS_H:
        h = tl.load(hh_ptr + rows_c).to(tl.float32) * inv_temp
        ent = tl.load(ent_ptr + rows_c).to(tl.float32)
        active = tl.max(tl.abs(g) + tl.abs(h), 0) > 0
    else:
        active = tl.max(tl.abs(g), 0) > 0
    if active:
        lse = tl.load(lse_ptr + rows_c).to(tl.float32)
        tgt = tl.load(targets_ptr + rows_c).to(tl.int64)
        x = _logits_tile(h_ptr, w_ptr, b_ptr, rows_c, cols_c, stride_hn, stride_wv, n_hidden,
                         HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_H)
        if HAS_SOFTCAP:
            c, dc = softcap_grad(x, softcap, 1.0 / softcap)
            dz = grad_block(c * inv_temp, cols, lse, g, h, ent, tgt, HAS_H) * dc
        else:
            dz = grad_block(x * inv_temp, cols, lse, g, h, ent, tgt, HAS_H)
        dz = tl.where(row_ok[:, None] & col_ok[None, :], dz, 0.0)
        if HAS_DB:
            tl.atomic_add(db_ptr + cols_c, tl.sum(dz, 0), mask=col_ok)
        # the matmul operands in the input dtype, as the chunked path's dZ (one rounding)
        dzq = dz.to(h_ptr.dtype.element_ty)
        for k0 in range(0, n_hidden, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_ok = ks < n_hidden
            if HAS_DH:
                wt = tl.load(w_ptr + cols_c[:, None] * stride_wv + ks[None, :], mask=k_ok[None, :], other=0.0)
                part = _dot(dzq, wt, tl.zeros([BLOCK_N, BLOCK_H], tl.float32))
                tl.atomic_add(dh_ptr + rows_c[:, None] * stride_dhn + ks[None, :], part,
                              mask=row_ok[:, None] & k_ok[None, :])
            if HAS_DW:
                ht = tl.load(h_ptr + rows_c[:, None] * stride_hn + ks[None, :], mask=k_ok[None, :], other=0.0)
                part = _dot(tl.trans(dzq), ht, tl.zeros([BLOCK_V, BLOCK_H], tl.float32))
                tl.atomic_add(dw_ptr + cols_c[:, None] * stride_dwv + ks[None, :], part,
                              mask=col_ok[:, None] & k_ok[None, :])


def _blocks(n: int, v: int, hdim: int, dtype: torch.dtype):
    """(BLOCK_N, BLOCK_V, BLOCK_H, num_warps) on a GPU: 64 × 128 × 64 for bf16 / fp16 (tensor-core
    tiles; sm_90: 108 / 136 registers, no spill); 32 × 128 × 32 for fp32, whose IEEE dots run on
    the FMA units (64 × 128 spilled 6 KB in the backward; benchmarks/compile_grid.py). Under the
    interpreter the smallest tiles that fit."""
    if INTERPRET:
        p2 = lambda x, hi: max(16, min(hi, triton.next_power_of_2(max(x, 1))))  # noqa: E731
        return p2(n, 64), p2(v, 128), p2(hdim, 64), 4
    return (32, 128, 32, 8) if dtype == torch.float32 else (64, 128, 64, 8)


def _check(hidden: torch.Tensor, weight: torch.Tensor):
    if hidden.dtype not in DTYPES:
        raise ValueError(f"hidden: impl='cce' supports {[str(d) for d in DTYPES]}, got {hidden.dtype}; "
                         "use impl='triton' or 'torch' for float64")
    if hidden.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("hidden / weight: impl='cce' needs unit column strides (call .contiguous())")


def cce_fwd(hidden, weight, bias, targets, temperature: float, need_entropy: bool, softcap: Optional[float] = None):
    """(logp, lse, entropy | None), each [N] fp32, of logits = hidden·weightᵀ + bias at τ (capped
    to softcap·tanh(z/softcap) first when `softcap` is given)."""
    _check(hidden, weight)
    n, hdim = hidden.shape
    v = weight.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if need_entropy else lse
    if n == 0:
        return logp, lse, (ent if need_entropy else None)
    bn, bv, bh, warps = _blocks(n, v, hdim, hidden.dtype)
    has_cap, cap, _ = split_softcap(softcap)
    _cce_fwd_kernel[(triton.cdiv(n, bn),)](
        hidden, weight, bias if bias is not None else weight, targets.contiguous(), logp, lse, ent,
        hidden.stride(0), weight.stride(0), n, v, hdim, split_inv_temp(temperature)[0], cap,
        HAS_BIAS=bias is not None, HAS_ENT=need_entropy, HAS_SOFTCAP=has_cap, BLOCK_N=bn, BLOCK_V=bv, BLOCK_H=bh,
        num_warps=warps)
    return logp, lse, (ent if need_entropy else None)


def cce_bwd(hidden, weight, bias, targets, lse, g, h: Optional[torch.Tensor], entropy: Optional[torch.Tensor],
            temperature: float, dh: Optional[torch.Tensor], dw: Optional[torch.Tensor], db: Optional[torch.Tensor],
            softcap: Optional[float] = None):
    """Accumulate ∂loss/∂hidden into `dh` [N, H] fp32, ∂loss/∂weight into `dw` [V, H] fp32 and
    ∂loss/∂bias into `db` [V] fp32 (each None = not needed); nothing of size N×V is made.
    `softcap`: the cap `cce_fwd` applied."""
    _check(hidden, weight)
    n, hdim = hidden.shape
    v = weight.shape[0]
    if n == 0 or (dh is None and dw is None and db is None):
        return
    for name, t in (("dh", dh), ("dw", dw), ("db", db)):
        if t is not None and (t.dtype != torch.float32 or t.stride(-1) != 1):
            raise ValueError(f"{name}: expected a float32 accumulator with unit column stride")
    bn, bv, bh, warps = _blocks(n, v, hdim, hidden.dtype)
    has_h = h is not None
    has_cap, cap, _ = split_softcap(softcap)
    dummy = lse
    _cce_bwd_kernel[(triton.cdiv(n, bn), triton.cdiv(v, bv))](
        hidden, weight, bias if bias is not None else weight, targets.contiguous(), lse.contiguous(), g.contiguous(),
        h.contiguous() if has_h else dummy, entropy.contiguous() if has_h else dummy,
        dh if dh is not None else dummy, dw if dw is not None else dummy, db if db is not None else dummy,
        hidden.stride(0), weight.stride(0), dh.stride(0) if dh is not None else 0, dw.stride(0) if dw is not None else 0,
        n, v, hdim, split_inv_temp(temperature)[0], cap,
        HAS_BIAS=bias is not None, HAS_H=has_h, HAS_SOFTCAP=has_cap, HAS_DH=dh is not None, HAS_DW=dw is not None,
        HAS_DB=db is not None, BLOCK_N=bn, BLOCK_V=bv, BLOCK_H=bh, num_warps=warps)
