"""The oracle: every quantity of the GRPO loss contract (shared/DESIGN.md) in plain torch.

Written for clarity, not speed: it materialises log_softmax over [N, V] and lets autograd
produce the gradients. Every other backend (the CPU streaming path in `cpu_stream.py`, the
Triton kernels) is tested against it in float64. Follows DeepSeekMath's GRPO objective with
the variants named in the contract: DAPO clip-higher (ε_low ≠ ε_high), the δ cap of TRL's
`delta`, dual clip (Ye et al. 2020), k1/k2/k3 KL (Schulman's estimators), GSPO's sequence-level
ratio, Dr. GRPO's `seq-mean-token-sum-norm`, and Gemma 2's final-logit soft-capping
(`LossConfig.softcap`: z ← cap·tanh(z/cap) before the temperature; everything after it, the
entropy and the KL included, sees the capped distribution).
"""
from __future__ import annotations

from typing import Optional

import torch

from fastgrpo.kernels.contract import (
    LossConfig,
    LossOutput,
    aggregation_weights,
    check_cu_seqlens,
    positive_or_one,
    seq_ids_from_cu,
)


def softcap_logits(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """cap·tanh(z/cap) (the identity for None), in the op order of transformers' Gemma 2 head
    (divide, tanh, multiply), so that float32 capped logits match the model's own bit for bit."""
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def token_logprobs_reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                             return_entropy: bool = False, softcap: Optional[float] = None):
    """logp_t = c_t[y_t]/τ − logsumexp(c_t/τ); H_t = −Σ p log p of softmax(c_t/τ), with
    c = softcap·tanh(z/softcap) (c = z when softcap is None).

    Computed in the input dtype (float64 in, float64 out), differentiable.
    """
    z = softcap_logits(logits, softcap) / temperature
    logsm = torch.log_softmax(z, dim=-1)
    logp = logsm.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = None
    if return_entropy:
        entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    return torch.exp(-d) + d - 1.0  # k3 = exp(ref−logp) − (ref−logp) − 1


def per_token_objective(logp, advantages, old_logp, ref_logp, weights, mask, seq_ids, num_seqs,
                        config: LossConfig, entropy=None):
    """ℓ_t of the contract and the pieces the metrics need. All tensors [N], any float dtype."""
    if old_logp is None:
        old_logp = logp.detach()
    log_ratio = logp - old_logp
    if config.ratio_level == "sequence":
        m = mask.to(log_ratio.dtype)
        num = torch.zeros(num_seqs, dtype=log_ratio.dtype, device=logp.device).index_add(0, seq_ids, log_ratio * m)
        den = torch.zeros(num_seqs, dtype=log_ratio.dtype, device=logp.device).index_add(0, seq_ids, m)
        log_ratio = (num / positive_or_one(den))[seq_ids]
    ratio = torch.exp(log_ratio)
    adv = advantages.to(ratio.dtype)
    capped = ratio if config.delta is None else torch.clamp(ratio, max=config.delta)
    clipped = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    obj = torch.minimum(capped * adv, clipped * adv)
    if config.dual_clip_c is not None:
        obj = torch.where(adv < 0, torch.maximum(obj, config.dual_clip_c * adv), obj)
    w = 1.0 if weights is None else weights.to(ratio.dtype)
    loss_t = -w * obj
    kl = None
    if config.beta != 0.0:
        if ref_logp is None:
            raise ValueError("ref_logp: required when LossConfig.beta > 0 (KL to the reference policy)")
        kl = kl_estimate(logp, ref_logp.to(logp.dtype), config.kl)
        if config.kl_ratio_correction:
            kl = kl * ratio
        loss_t = loss_t + config.beta * kl
    if config.entropy_coef != 0.0:
        loss_t = loss_t - config.entropy_coef * entropy
    return loss_t, ratio, kl


def loss_metrics(ratio, adv, kl, entropy, mask, config: LossConfig):
    """Masked means over completion tokens. Clip fractions follow TRL: low = r < 1−ε_low with
    A < 0, high = r > 1+ε_high with A > 0 (the tokens whose gradient the clip removed)."""
    m = mask.to(torch.float64)
    cnt = positive_or_one(m.sum())
    r = ratio.detach().to(torch.float64)
    a = adv.detach().to(torch.float64)
    out = {
        "clip_frac_low": (((r < 1 - config.eps_low) & (a < 0)).double() * m).sum() / cnt,
        "clip_frac_high": (((r > 1 + config.eps_high) & (a > 0)).double() * m).sum() / cnt,
        "ratio_mean": (r * m).sum() / cnt,
    }
    on = m > 0
    if bool(on.any()):
        out["ratio_min"], out["ratio_max"] = r[on].min(), r[on].max()
    else:
        out["ratio_min"] = out["ratio_max"] = torch.ones((), dtype=torch.float64, device=r.device)
    if config.dual_clip_c is not None:
        out["dual_clip_frac"] = (((a < 0) & (r * a < config.dual_clip_c * a)).double() * m).sum() / cnt
    if kl is not None:
        out["kl_mean"] = (kl.detach().double() * m).sum() / cnt
    if entropy is not None:
        out["entropy_mean"] = (entropy.detach().double() * m).sum() / cnt
    return {k: v.float() for k, v in out.items()}


def grpo_loss_reference(logits: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor,
                        mask: Optional[torch.Tensor] = None, old_logp=None, ref_logp=None,
                        weights=None, cu_seqlens=None, config: Optional[LossConfig] = None,
                        num_items=None, return_entropy: bool = False) -> LossOutput:
    """The whole contract with autograd: loss = Σ_t a_t·ℓ_t (a_t from `aggregation_weights`)."""
    config = config or LossConfig()
    n = logits.shape[0]
    if mask is None:
        mask = torch.ones(n, dtype=logits.dtype, device=logits.device)
    cu = check_cu_seqlens(cu_seqlens, n)
    num_seqs = cu.numel() - 1
    seq_ids = seq_ids_from_cu(cu, logits.device)
    need_ent = return_entropy or config.entropy_coef != 0.0
    logp, entropy = token_logprobs_reference(logits, targets, config.temperature, need_ent, config.softcap)
    # Off-mask positions may hold garbage (old/ref log-probs of 0 or −inf on prompt tokens, NaN
    # weights): give them neutral values (ratio 1, KL 0, advantage and weight 0) so that a_t = 0
    # there cannot meet an inf and make the loss or a gradient NaN.
    on = mask != 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    advantages = torch.where(on, advantages.to(logp.dtype), zero)
    if old_logp is not None:
        old_logp = torch.where(on, old_logp.to(logp.dtype), logp.detach())
    if ref_logp is not None:
        ref_logp = torch.where(on, ref_logp.to(logp.dtype), logp.detach())
    if weights is not None:
        weights = torch.where(on, weights.to(logp.dtype), zero)
    loss_t, ratio, kl = per_token_objective(logp, advantages, old_logp, ref_logp, weights, mask,
                                            seq_ids, num_seqs, config, entropy)
    agg = aggregation_weights(mask, seq_ids, num_seqs, config, num_items).to(loss_t.dtype)
    loss = (agg * loss_t).sum()
    metrics = loss_metrics(ratio, advantages, kl, entropy, mask, config)
    return LossOutput(loss=loss, logp=logp.detach(),
                      entropy=entropy.detach() if entropy is not None else None, metrics=metrics)
