"""Differentiable per-token log-probs and entropies straight from hidden states and the lm_head
weight, with TRL's logit transform (scale, then Gemma-style tanh soft-cap, then 1/τ), for the
TRL drop-in's configurations whose objective is not the fused loss contract (cispo, sapo, luspo,
vespo, the entropy bonus, entropy / off-policy masks, MoE auxiliary loss, soft-capped logits).

Algorithm: the chunked lm_head of Liger-Kernel / TRL's `ChunkedLogProbFunction`, on fastgrpo's
kernels: tokens go C rows at a time; a chunk's logits [C, V] are one matmul, transformed in place
(z ← cap·tanh(scale·y/cap)), and reduced by the streaming statistics pass (`cpu_stream` on CPU,
the Triton `token_logprobs_fwd` on CUDA) to logp, lse and H, then freed. The backward receives
g = ∂L/∂logp and h = ∂L/∂H from any O(N) objective (TRL's own, here), recomputes each chunk's
logits, lets the kernel write ∂L/∂z in place (`logits_grad` / `grpo_loss_bwd`), chains through
the transform (∂z/∂y = scale·(1 − tanh²)) and makes dH, dW, db: 4 matmuls in all, one more than
the fused loss (`fused_linear_grpo_loss`, which knows its objective up front and makes the
gradient in the forward). Nothing of size N×V outlives a chunk.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastgrpo.kernels import cpu_stream
from fastgrpo.kernels.fused_linear import default_chunk_size


def head_logit_transform(text_config):
    """(softcap | None, scale) TRL 1.16's fused lm head applies to the logits before 1/τ, read from
    the model's text config the way `trl.trainer.utils.add_fused_lm_head` reads it."""
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        s = text_config.logits_scaling  # Granite / MiniCPM3 divide by it; HyperCLOVA X multiplies
        scale = s if getattr(text_config, "model_type", None) == "hyperclovax" else 1 / s
    return (float(softcap) if softcap else None), (1.0 if scale is None else float(scale))


def _backend(device: torch.device):
    if device.type == "cuda":
        from fastgrpo.kernels.triton.grpo_loss import grpo_loss_bwd
        from fastgrpo.kernels.triton.logprobs import token_logprobs_fwd

        return token_logprobs_fwd, (lambda z, y, lse, g, h, e, tau: grpo_loss_bwd(z, y, lse, g, h, e, tau, out=z))
    return cpu_stream.logprob_stats, (lambda z, y, lse, g, h, e, tau: cpu_stream.logits_grad(z, y, lse, g, h, e, tau,
                                                                                            out=z))


def _chunk(hidden, weight, bias, s, e, softcap, scale):
    """Transformed logits of tokens s:e and tanh of the cap (None without a cap)."""
    y = torch.mm(hidden[s:e], weight.t()) if bias is None else torch.addmm(bias, hidden[s:e], weight.t())
    if softcap is None:
        return (y if scale == 1.0 else y.mul_(scale)), None
    y = y.float() if y.dtype in (torch.float16, torch.bfloat16) else y  # the cap's tanh in fp32 at least
    t = torch.tanh(y * (scale / softcap))
    return t * softcap, t


class FusedHeadLogprobsFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) → (logp [N], entropy [N] or
    empty) of softmax(transform(hidden·Wᵀ + b)/τ); see the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, scale, need_entropy, chunk):
        n = hidden.shape[0]
        cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        fwd, _ = _backend(hidden.device)
        logp = torch.empty(n, dtype=cdt, device=hidden.device)
        lse = torch.empty(n, dtype=cdt, device=hidden.device)
        ent = torch.empty(n, dtype=cdt, device=hidden.device) if need_entropy else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z, _ = _chunk(hidden, weight, bias, s, e, softcap, scale)
            lp, ls, en = fwd(z, targets[s:e], temperature, need_entropy)
            logp[s:e], lse[s:e] = lp, ls
            if need_entropy:
                ent[s:e] = en
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.args = (temperature, softcap, scale, chunk)
        if ent is None:
            ent = lse.new_empty(0)
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        tau, softcap, scale, chunk = ctx.args
        _, bwd = _backend(hidden.device)
        n = hidden.shape[0]
        cdt = lse.dtype
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        g = torch.zeros_like(lse) if g_logp is None else g_logp.to(cdt)
        h = None if (ent is None or g_ent is None or g_ent.numel() == 0) else g_ent.to(cdt)
        dh = torch.empty_like(hidden) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_dw else None
        db = torch.zeros(weight.shape[0], dtype=cdt, device=weight.device) if need_db else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z, t = _chunk(hidden, weight, bias, s, e, softcap, scale)
            dz = bwd(z, targets[s:e], lse[s:e], g[s:e], None if h is None else h[s:e],
                     None if h is None else ent[s:e], tau)
            if t is not None:
                dz = dz * ((1 - t * t) * scale)
            elif scale != 1.0:
                dz = dz.mul_(scale)
            if need_dh:
                dh[s:e] = torch.mm(dz.to(weight.dtype), weight)
            if need_dw:
                dw.addmm_(dz.t().to(cdt), hidden[s:e].to(cdt))
            if need_db:
                db.add_(dz.sum(0, dtype=cdt))
            del z, dz, t
        return (dh, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
                None, None, None, None, None, None)


def fused_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                        bias: Optional[torch.Tensor] = None, softcap: Optional[float] = None, scale: float = 1.0,
                        need_entropy: bool = True, chunk_size: Optional[int] = None):
    """(logp [N], entropy [N] | None), differentiable w.r.t. hidden, weight and bias."""
    if not (temperature > 0):
        raise ValueError(f"temperature: expected a number > 0, got {temperature!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected None or a number > 0 (final_logit_softcapping), got {softcap!r}")
    n = hidden.shape[0]
    chunk = chunk_size or default_chunk_size(max(n, 1), weight.shape[0], hidden.dtype, hidden.device)
    logp, ent = FusedHeadLogprobsFunction.apply(hidden, weight, bias, targets, float(temperature), softcap,
                                                float(scale), bool(need_entropy), int(chunk))
    return logp, (ent if need_entropy else None)
