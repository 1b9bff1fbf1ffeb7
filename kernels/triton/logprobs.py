"""Triton token log-probs (and entropy) of packed logits, no grad: the scorer of old, reference
and rollout policies, and the forward pass of the fused GRPO loss (`grpo_loss.py` reuses the
launcher below, which also returns the per-row log-sum-exp its backward needs).

One read of the logits: each program owns BLOCK_N rows and walks the vocabulary in BLOCK_V
blocks with the online log-sum-exp of Milakov & Gimelshein (2018) in fp32 (fp64 for fp64
input), the entropy as a second running sum, and the target logit by one gathered load per row.
NaN / +Inf need no extra pass: either makes the row's log-sum-exp, hence its logp, non-finite,
which the facade (`fastgrpo.loss`) turns into the same ValueError as for the torch path. −Inf
logits (e.g. a masked-out vocabulary slot) are valid, probability 0, as in the oracle.
With a soft cap (`HAS_SOFTCAP`, Gemma 2's final_logit_softcapping) every loaded block is capped,
c = cap·tanh(z/cap), before the 1/τ scale (`_common.apply_softcap`); a −inf logit then becomes −cap
(a small probability, as in the model's own capped forward) and +Inf becomes +cap (finite: only
NaN is still caught).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from fastgrpo.kernels.triton._common import (
    apply_softcap, grid_rows, load_cap, load_scale, online_lse_update, row_major_logits, row_tile, split_inv_temp,
    split_softcap)
from fastgrpo.kernels.triton._tune import TunedKernel


@triton.jit
def _token_logprobs_fwd_kernel(
    logits_ptr,  # [N, V] logits, row stride stride_n, unit column stride
    targets_ptr,  # [N] int target ids
    logp_ptr,  # [N] out: z[y]/τ − lse
    lse_ptr,  # [N] out: logsumexp(z/τ) (non-finite on rows holding NaN/+Inf)
    ent_ptr,  # [N] out: entropy of softmax(z/τ) (written when HAS_ENT)
    stride_n,  # row stride of logits, in elements
    n_rows,  # N
    n_cols,  # V
    inv_temp,  # 1/τ (fp32 part), runtime so that a new temperature does not recompile
    inv_temp_lo,  # 1/τ − inv_temp, the fp32 remainder used by the fp64 path
    softcap,  # soft cap (fp32 part), runtime: a new cap does not recompile; read when HAS_SOFTCAP
    softcap_lo,  # softcap − its fp32 part, used by the fp64 path
    HAS_ENT: tl.constexpr,  # write the entropy
    HAS_SOFTCAP: tl.constexpr,  # cap the logits: z ← softcap·tanh(z/softcap) before 1/τ
    FP64: tl.constexpr,  # accumulate in fp64 (fp64 logits) instead of fp32
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_V: tl.constexpr,  # vocabulary columns per step
):
    acc_t = tl.float64 if FP64 else tl.float32
    scale = load_scale(inv_temp, inv_temp_lo, FP64)
    cap, inv_cap = load_cap(softcap, softcap_lo, FP64)
    pid = tl.program_id(0)
    rows, row_ok, rows_c = row_tile(pid, n_rows, BLOCK_N)
    row_ptr = logits_ptr + rows_c * stride_n
    m = tl.full([BLOCK_N], float("-inf"), acc_t)
    s = tl.zeros([BLOCK_N], acc_t)
    t = tl.zeros([BLOCK_N], acc_t)
    # Full blocks without a mask (rows are clamped, so every address is valid): a column mask
    # against an odd V would be non-uniform within a vector and force one load per element.
    n_full = (n_cols // BLOCK_V) * BLOCK_V
    for v0 in range(0, n_full, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr[:, None] + cols[None, :]).to(acc_t)
        if HAS_SOFTCAP:
            x = apply_softcap(x, cap, inv_cap)
        m, s, t = online_lse_update(x * scale, m, s, t, HAS_ENT)
    if n_full < n_cols:  # the peeled tail: one masked block
        cols = n_full + tl.arange(0, BLOCK_V)
        col_ok = (cols < n_cols)[None, :]
        x = tl.load(row_ptr[:, None] + cols[None, :], mask=col_ok, other=float("-inf")).to(acc_t)
        if HAS_SOFTCAP:  # the cap maps the −inf padding to −cap: mask it out again
            x = tl.where(col_ok, apply_softcap(x, cap, inv_cap), float("-inf"))
        m, s, t = online_lse_update(x * scale, m, s, t, HAS_ENT)
    lse = m + tl.log(s)
    tgt = tl.load(targets_ptr + rows_c).to(tl.int64)
    xt = tl.load(logits_ptr + rows_c * stride_n + tgt).to(acc_t)
    if HAS_SOFTCAP:
        xt = apply_softcap(xt, cap, inv_cap)
    xt = xt * scale
    tl.store(logp_ptr + rows, xt - lse, mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    if HAS_ENT:
        tl.store(ent_ptr + rows, tl.log(s) - t / s, mask=row_ok)


TOKEN_LOGPROBS_FWD = TunedKernel(_token_logprobs_fwd_kernel, "token_logprobs_fwd")


def token_logprobs_fwd(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                       need_entropy: bool, softcap: Optional[float] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launcher: (logp, lse, entropy | None), each [N] fp32 (fp64 for fp64 logits), of
    softmax(c/τ), c = softcap·tanh(z/softcap) (c = z for softcap None). Takes any row stride; a
    non-unit column stride is copied once (see `row_major_logits`)."""
    logits = row_major_logits(logits)
    n, v = logits.shape
    out_t = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.empty(n, dtype=out_t, device=logits.device)
    lse = torch.empty(n, dtype=out_t, device=logits.device)
    ent = torch.empty(n, dtype=out_t, device=logits.device) if need_entropy else lse
    if n == 0:
        return logp, lse, (ent if need_entropy else None)
    targets = targets.contiguous()
    inv = split_inv_temp(temperature)
    has_cap, *cap = split_softcap(softcap)

    def scratch(rows):  # read a slice of the caller's logits, write fresh [rows] outputs
        outs = [torch.empty(rows, dtype=out_t, device=logits.device) for _ in range(3)]
        return (logits[:rows], targets[:rows], *outs, logits.stride(0), rows, v, *inv, *cap)

    TOKEN_LOGPROBS_FWD.launch(
        grid_rows, (logits, targets, logp, lse, ent, logits.stride(0), n, v, *inv, *cap),
        dict(HAS_ENT=need_entropy, HAS_SOFTCAP=has_cap, FP64=logits.dtype == torch.float64), n_rows=n, n_cols=v,
        strides=(logits.stride(0),), row_bytes=v * logits.element_size(), scratch=scratch)
    return logp, lse, (ent if need_entropy else None)


def token_logprobs_triton(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                          return_entropy: bool = False, softcap: Optional[float] = None
                          ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """No-grad (logp [N], entropy [N] | None) at temperature τ (of the capped logits when
    `softcap` is given); input validated by the facade, which also checks the result is finite."""
    with torch.no_grad():
        logp, _, ent = token_logprobs_fwd(logits, targets, temperature, return_entropy, softcap)
    return logp, ent
