"""Fused GRPO loss on packed logits [N, V] with Triton: the whole loss contract of
shared/DESIGN.md (token / sequence-level ratio, δ cap, clip ε_low/ε_high, dual clip, k1/k2/k3 KL
with optional ratio correction, per-token weights, entropy bonus, every aggregation).

Three phases, like Liger-Kernel's `triton_grpo_loss` but with the O(N) objective split out:
1. forward kernel (`logprobs.token_logprobs_fwd`): one read of the logits → logp_t, lse_t, H_t;
2. the O(N) objective in torch on [N] vectors (`objective.py`, shared with the CPU path, fp32 or
   fp64 for fp64 input) under autograd: every aggregation is a per-token weight a_t
   (`common.aggregation_weights`) and the sequence-level ratio couples tokens only through [N]
   vectors, so no option needs a kernel of its own; its backward hands g_t = ∂loss/∂logp_t and
   h_t = ∂loss/∂H_t to
3. the backward kernel: one read, one write: ∂loss/∂z_j = g_t·(δ_{j,y_t} − p_j)/τ
   − h_t·p_j·(log p_j + H_t)/τ, into the logits buffer itself when `inplace_backward=True`.
Departures from Liger: 2-D row tiles on a 1-D grid (no 65 535-row limit), every option as a
runtime scalar or [N] vector (a new ε/β/τ/cap never recompiles), and tiles whose rows all have
g = h = 0 (prompt / masked tokens) write zeros without reading the logits.
Soft cap (`LossConfig.softcap`, Gemma 2/3): both kernels cap each loaded block themselves,
c = cap·tanh(z/cap) (`HAS_SOFTCAP`), and the backward multiplies by ∂c/∂z = 1 − tanh²(z/cap), so
the (in-place) gradient is w.r.t. the uncapped logits and no capped [N, V] copy is ever made.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fastgrpo.kernels.contract import LogprobsBackend, LossConfig, LossOutput, check_cu_seqlens, differentiable_logprobs
from fastgrpo.kernels.triton.logprobs import token_logprobs_fwd
from fastgrpo.kernels.cpu_stream import loss_from_logprobs
from fastgrpo.kernels.triton._common import (
    capped_grad_block, grad_block, grid_rows, load_cap, load_scale, row_major_logits, row_tile, softcap_grad,
    split_inv_temp, split_softcap)
from fastgrpo.kernels.triton._tune import TunedKernel


@triton.jit
def _any_grad_block(x, cols, lse, g, h, ent, tgt, g_dc_tgt, scale, cap, inv_cap, HAS_H: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr):
    """The gradient of one block of raw logits x: `grad_block`, or `capped_grad_block` with the cap."""
    if HAS_SOFTCAP:
        grad = capped_grad_block(x, cols, lse, g, h, ent, tgt, g_dc_tgt, scale, cap, inv_cap, HAS_H)
    else:
        grad = grad_block(x * scale, cols, lse, g, h, ent, tgt, HAS_H)
    return grad


@triton.jit
def _grpo_loss_bwd_kernel(
    logits_ptr,  # [N, V] logits, row stride stride_n, unit column stride
    grad_ptr,  # [N, V] out: ∂loss/∂logits (may be logits_ptr itself: in place)
    targets_ptr,  # [N] int target ids
    lse_ptr,  # [N] logsumexp(z/τ) from the forward kernel
    g_ptr,  # [N] ∂loss/∂logp_t (already times the incoming gradient)
    h_ptr,  # [N] ∂loss/∂H_t (read when HAS_H)
    ent_ptr,  # [N] H_t (read when HAS_H)
    stride_n,  # row stride of logits, in elements
    stride_gn,  # row stride of grad, in elements
    n_rows,  # N
    n_cols,  # V
    inv_temp,  # 1/τ (fp32 part), runtime: a new temperature does not recompile
    inv_temp_lo,  # 1/τ − inv_temp, the fp32 remainder used by the fp64 path
    softcap,  # soft cap (fp32 part), runtime: a new cap does not recompile; read when HAS_SOFTCAP
    softcap_lo,  # softcap − its fp32 part, used by the fp64 path
    HAS_H: tl.constexpr,  # entropy term present (α ≠ 0)
    HAS_SOFTCAP: tl.constexpr,  # the forward capped the logits: z ← softcap·tanh(z/softcap)
    FP64: tl.constexpr,  # compute in fp64 (fp64 logits)
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_V: tl.constexpr,  # vocabulary columns per step
):
    acc_t = tl.float64 if FP64 else tl.float32
    scale = load_scale(inv_temp, inv_temp_lo, FP64)
    cap, inv_cap = load_cap(softcap, softcap_lo, FP64)
    pid = tl.program_id(0)
    rows, row_ok, rows_c = row_tile(pid, n_rows, BLOCK_N)
    row_ptr = logits_ptr + rows_c * stride_n
    out_ptr = grad_ptr + rows_c * stride_gn
    g = tl.load(g_ptr + rows_c).to(acc_t) * scale
    lse = tl.load(lse_ptr + rows_c).to(acc_t)
    tgt = tl.load(targets_ptr + rows_c).to(tl.int64)
    g_dc_tgt = g
    if HAS_SOFTCAP:  # g·∂c/∂z at the target, from one gathered load per row
        _, dc_t = softcap_grad(tl.load(logits_ptr + rows_c * stride_n + tgt).to(acc_t), cap, inv_cap)
        g_dc_tgt = g * dc_t
    h = g
    ent = lse
    if HAS_H:
        h = tl.load(h_ptr + rows_c).to(acc_t) * scale
        ent = tl.load(ent_ptr + rows_c).to(acc_t)
        active = tl.max(tl.abs(g) + tl.abs(h), 0) > 0
    else:
        active = tl.max(tl.abs(g), 0) > 0
    # Full blocks: loads unmasked (rows are clamped), stores masked by row only, uniform along a
    # vector; the odd-V tail is one masked block (see logprobs.py).
    n_full = (n_cols // BLOCK_V) * BLOCK_V
    st_ok = row_ok[:, None]
    if active:
        for v0 in range(0, n_full, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr[:, None] + cols[None, :]).to(acc_t)
            grad = _any_grad_block(x, cols, lse, g, h, ent, tgt, g_dc_tgt, scale, cap, inv_cap, HAS_H, HAS_SOFTCAP)
            tl.store(out_ptr[:, None] + cols[None, :], grad.to(grad_ptr.dtype.element_ty), mask=st_ok)
        if n_full < n_cols:
            cols = n_full + tl.arange(0, BLOCK_V)
            ok = st_ok & (cols < n_cols)[None, :]
            x = tl.load(row_ptr[:, None] + cols[None, :], mask=ok, other=0.0).to(acc_t)
            grad = _any_grad_block(x, cols, lse, g, h, ent, tgt, g_dc_tgt, scale, cap, inv_cap, HAS_H, HAS_SOFTCAP)
            tl.store(out_ptr[:, None] + cols[None, :], grad.to(grad_ptr.dtype.element_ty), mask=ok)
    else:
        # Masked-out rows (a_t = 0, e.g. prompt tokens): the gradient is exactly zero.
        zero = tl.zeros([BLOCK_N, BLOCK_V], tl.float32).to(grad_ptr.dtype.element_ty)
        for v0 in range(0, n_full, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            tl.store(out_ptr[:, None] + cols[None, :], zero, mask=st_ok)
        if n_full < n_cols:
            cols = n_full + tl.arange(0, BLOCK_V)
            tl.store(out_ptr[:, None] + cols[None, :], zero, mask=st_ok & (cols < n_cols)[None, :])


# the soft-capped backward is register-heavier: its tiles are sized as for fp32 (see _tune)
GRPO_LOSS_BWD = TunedKernel(_grpo_loss_bwd_kernel, "grpo_loss_bwd", heavy_flag="HAS_SOFTCAP")


def grpo_loss_bwd(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                  h: Optional[torch.Tensor], entropy: Optional[torch.Tensor], temperature: float,
                  out: Optional[torch.Tensor] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Launcher: ∂loss/∂logits into `out` (pass `out=logits` for in place; default: a new
    tensor shaped and typed like logits). `logits` must have unit column stride. `softcap`: the
    cap the forward applied (lse is then that of the capped logits); the gradient is w.r.t. the
    uncapped logits."""
    n, v = logits.shape
    if out is None:
        out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    has_h = h is not None
    targets, lse, g = targets.contiguous(), lse.contiguous(), g.contiguous()
    h = h.contiguous() if has_h else g
    entropy = entropy.contiguous() if has_h else lse
    inv = split_inv_temp(temperature)
    has_cap, *cap = split_softcap(softcap)

    def scratch(rows):
        # Tuning reads a slice of the logits and writes a fresh [rows, V] buffer, never `out`
        # (which may be the logits themselves); g = h = 1 times the full path, not the zero fill.
        ones = torch.ones(rows, dtype=g.dtype, device=g.device)
        tmp = torch.empty((rows, v), dtype=out.dtype, device=out.device)
        return (logits[:rows], tmp, targets[:rows], lse[:rows], ones, ones, entropy[:rows],
                logits.stride(0), tmp.stride(0), rows, v, *inv, *cap)

    GRPO_LOSS_BWD.launch(
        grid_rows, (logits, out, targets, lse, g, h, entropy, logits.stride(0), out.stride(0), n, v, *inv, *cap),
        dict(HAS_H=has_h, HAS_SOFTCAP=has_cap, FP64=logits.dtype == torch.float64), n_rows=n, n_cols=v,
        strides=(logits.stride(0), out.stride(0)), row_bytes=v * logits.element_size(), scratch=scratch)
    return out


TRITON_BACKEND = LogprobsBackend(stats=token_logprobs_fwd, grad=grpo_loss_bwd)


def token_logprobs_triton_grad(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                               return_entropy: bool = False, inplace_backward: bool = False,
                               softcap: Optional[float] = None):
    """Differentiable (logp, entropy | None), [N] fp32 (fp64 for fp64 logits)."""
    # the backward kernel needs a unit column stride: a strided view is copied once, on the graph
    return differentiable_logprobs(TRITON_BACKEND, row_major_logits(logits), targets, temperature,
                                   return_entropy, inplace_backward, softcap)


def grpo_loss_triton(logits: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor, *,
                     mask: Optional[torch.Tensor] = None, old_logp: Optional[torch.Tensor] = None,
                     ref_logp: Optional[torch.Tensor] = None, weights: Optional[torch.Tensor] = None,
                     cu_seqlens: Optional[torch.Tensor] = None, config: Optional[LossConfig] = None,
                     num_items=None, inplace_backward: bool = False,
                     return_entropy: bool = False) -> LossOutput:
    """The Triton backend of `fastgrpo.loss.grpo_loss` (input validated by the facade).

    Logits may have any row stride (e.g. a `[:, :-1]`-style view of a contiguous buffer); a
    non-unit column stride costs one contiguous copy. With `inplace_backward=True` the backward
    overwrites the logits buffer with its gradient: the logits must not be needed afterwards
    (the lm_head matmul's backward needs only the hidden states and the weight). A leaf tensor
    (not produced by an autograd op) is never overwritten: the flag is ignored for it.
    """
    config = config or LossConfig()
    cu = check_cu_seqlens(cu_seqlens, logits.shape[0])
    need_ent = return_entropy or config.entropy_coef != 0.0
    logp, ent = token_logprobs_triton_grad(logits, targets, config.temperature, need_ent, inplace_backward,
                                           config.softcap)
    return loss_from_logprobs(logp, ent, logits.shape[0], logits.device, advantages, mask=mask,
                              old_logp=old_logp, ref_logp=ref_logp, weights=weights, cu_seqlens=cu,
                              config=config, num_items=num_items, return_entropy=need_ent)
