"""The CPU / plain-torch fused lm_head + GRPO loss: hidden [N, H] and weight [V, H] to the loss
without an [N, V] logits tensor.

Follows the chunked-linear scheme of Liger-Kernel's fused linear losses and TRL's chunked
log-prob head: tokens are processed `chunk_size` at a time; each chunk's logits are made by one
matmul, reduced by the vocabulary-streaming statistics of `torch_loss.py`, and freed. The
backward recomputes each chunk's logits, overwrites them with ∂loss/∂logits in place
(`torch_loss.logits_grad`) and turns them into ∂hidden (a matmul) and ∂weight / ∂bias (accumulated
in float32 across chunks, as the issue asks). Departure from Liger: the gradient is not computed
during the forward, so the objective stays ordinary autograd over [N] log-probs and sequence-level
ratios or per-sequence aggregations that couple chunks need no special casing.
Peak extra memory: one chunk of logits (chunk·V) + fp32 weight-gradient accumulator + O(N).
"""
from __future__ import annotations

from typing import Optional

import torch

from .common import LossConfig, LossOutput
from .torch_loss import compute_dtype, logits_grad, logprob_stats, loss_from_logprobs

# Default chunk: 2^25 logits (128 MiB in fp32) per chunk keeps the matmul large enough to run at
# full speed (hundreds of rows even at V = 152k) while staying far below N×V.
_CHUNK_ELEMS = 1 << 25


def default_chunk_size(n: int, v: int) -> int:
    return max(1, min(max(n, 1), _CHUNK_ELEMS // max(v, 1)))


def _chunk_logits(hidden_c, weight, bias):
    z = hidden_c @ weight.t()
    if bias is not None:
        z += bias
    return z


class FusedLinearLogprobsFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) → (logp [N], entropy [N] | empty)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, need_entropy, chunk_size):
        n = hidden.shape[0]
        cdt = compute_dtype(hidden.dtype)
        logp = torch.empty(n, dtype=cdt, device=hidden.device)
        lse = torch.empty(n, dtype=cdt, device=hidden.device)
        ent = torch.empty(n if need_entropy else 0, dtype=cdt, device=hidden.device)
        for c0 in range(0, n, chunk_size):
            c1 = min(n, c0 + chunk_size)
            z = _chunk_logits(hidden[c0:c1], weight, bias)
            lp, ls, en = logprob_stats(z, targets[c0:c1], temperature, need_entropy)
            logp[c0:c1], lse[c0:c1] = lp, ls
            if need_entropy:
                ent[c0:c1] = en
            del z
        ctx.save_for_backward(hidden, weight, bias if bias is not None else hidden.new_empty(0), targets, lse, ent)
        ctx.has_bias, ctx.temperature, ctx.need_entropy, ctx.chunk_size = bias is not None, temperature, \
            need_entropy, chunk_size
        if not need_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        n = hidden.shape[0]
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        h = g_ent if (ctx.need_entropy and g_ent is not None) else None
        want_h, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_hidden = torch.empty_like(hidden) if want_h else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if (want_b and bias is not None) else None
        for c0 in range(0, n, ctx.chunk_size):
            c1 = min(n, c0 + ctx.chunk_size)
            z = _chunk_logits(hidden[c0:c1], weight, bias)
            dz = logits_grad(z, targets[c0:c1], lse[c0:c1], g_logp[c0:c1], None if h is None else h[c0:c1],
                             None if h is None else ent[c0:c1], ctx.temperature, out=z)
            if want_h:
                torch.matmul(dz, weight, out=grad_hidden[c0:c1])
            if want_w:
                grad_weight.addmm_(dz.t().to(acc), hidden[c0:c1].to(acc))
            if grad_bias is not None:
                grad_bias += dz.sum(0, dtype=acc)
            del z, dz
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def fused_linear_grpo_loss_torch(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 advantages: torch.Tensor, *, bias=None, mask=None, old_logp=None, ref_logp=None,
                                 weights=None, cu_seqlens=None, config: Optional[LossConfig] = None,
                                 num_items=None, chunk_size: Optional[int] = None,
                                 return_entropy: bool = False) -> LossOutput:
    """Loss contract from hidden states (inputs validated by the facade `fastgrpo.loss`)."""
    config = config or LossConfig()
    n = hidden.shape[0]
    chunk = chunk_size or default_chunk_size(n, weight.shape[0])
    need_ent = return_entropy or config.entropy_coef != 0.0
    logp, ent = FusedLinearLogprobsFunction.apply(hidden, weight, bias, targets, float(config.temperature),
                                                  bool(need_ent), int(chunk))
    return loss_from_logprobs(logp, ent if need_ent else None, n, hidden.device, advantages, mask=mask,
                              old_logp=old_logp, ref_logp=ref_logp, weights=weights, cu_seqlens=cu_seqlens,
                              config=config, num_items=num_items, return_entropy=need_ent)
