"""The O(N) half of the GRPO loss contract (shared/DESIGN.md), shared by every fast backend.

Given per-token log-probs `logp [N]` (and entropies `H [N]`) that some backend produced from the
logits, this module computes everything else of the contract on [N] vectors with plain torch:
ratio (token level, or GSPO's sequence level), δ cap, ε_low/ε_high clip, dual clip, k1/k2/k3 KL
(optionally × ratio as TRL's `use_bias_correction_kl`), the entropy bonus, the aggregation
weights a_t of `common.aggregation_weights`, the loss Σ a_t·ℓ_t and the metrics.

`objective_coefficients` returns the loss together with the per-token coefficients
g_t = ∂loss/∂logp_t and h_t = ∂loss/∂H_t, which is all a vocabulary-streaming backward needs:
∂loss/∂z_tj = (g_t·(onehot(y_t)_j − p_tj) − h_t·p_tj·(log p_tj + H_t)) / τ.
The CPU path (`cpu_stream.py`) uses the differentiable `objective_loss` inside autograd; a Triton
backend can call `objective_coefficients` between its statistics pass and its gradient pass.

Departure from the oracle (`reference.py`), by design: positions with mask 0 may carry garbage
(old/ref log-probs of 0 or −inf for prompt tokens, NaN weights); they are replaced by neutral
values before any arithmetic so that they can never turn the loss or a gradient into NaN.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch

from fastgrpo.kernels.contract import LossConfig, aggregation_weights, positive_or_one, seq_ids_from_cu


@dataclass
class ObjectiveInputs:
    """Per-token inputs of the objective after masking, in the compute dtype (fp32 or fp64)."""

    on: torch.Tensor  # [N] bool, mask != 0
    mask: torch.Tensor  # [N] float mask values (a fractional mask weights tokens)
    advantages: torch.Tensor  # [N], 0 off-mask
    old_logp: Optional[torch.Tensor]  # [N], 0 off-mask; None → on-policy (ratio 1)
    ref_logp: Optional[torch.Tensor]  # [N], 0 off-mask; None when beta = 0
    weights: Optional[torch.Tensor]  # [N], 0 off-mask
    seq_ids: torch.Tensor  # [N] int64 sequence index
    num_seqs: int
    agg: torch.Tensor  # [N] aggregation weight a_t (loss = Σ a_t·ℓ_t)


def prepare_objective(n: int, device, dtype, advantages, mask=None, old_logp=None, ref_logp=None,
                      weights=None, cu=None, config: LossConfig = LossConfig(), num_items=None) -> ObjectiveInputs:
    """Mask out garbage and precompute sequence ids and aggregation weights (all [N])."""
    if mask is None:
        maskf = torch.ones(n, dtype=dtype, device=device)
        on = torch.ones(n, dtype=torch.bool, device=device)
    else:
        on = mask != 0
        maskf = torch.where(on, mask.to(dtype), torch.zeros((), dtype=dtype, device=device))
    zero = torch.zeros((), dtype=dtype, device=device)

    def clean(x):
        return None if x is None else torch.where(on, x.detach().to(dtype), zero)

    if cu is None:
        cu = torch.tensor([0, n], dtype=torch.int64)
    num_seqs = cu.numel() - 1
    seq_ids = seq_ids_from_cu(cu, device)
    agg = aggregation_weights(maskf, seq_ids, num_seqs, config, num_items).to(dtype)
    if config.beta == 0.0:
        ref_logp = None
    elif ref_logp is None:
        raise ValueError("ref_logp: required when LossConfig.beta > 0 (KL to the reference policy), "
                         "expected a float tensor [N]")
    return ObjectiveInputs(on=on, mask=maskf, advantages=clean(advantages), old_logp=clean(old_logp),
                           ref_logp=clean(ref_logp), weights=clean(weights), seq_ids=seq_ids,
                           num_seqs=num_seqs, agg=agg)


def slice_objective(inp: ObjectiveInputs, start: int, end: int) -> ObjectiveInputs:
    """Tokens start:end of `inp`, for backends that run the objective block by block. Exact only for
    token-level ratios (a sequence-level ratio couples the tokens of a sequence); the aggregation
    weights were computed over all N tokens, so block losses add up to the full loss."""
    cut = (lambda x: None if x is None else x[start:end])
    return replace(inp, on=inp.on[start:end], mask=inp.mask[start:end], advantages=cut(inp.advantages),
                   old_logp=cut(inp.old_logp), ref_logp=cut(inp.ref_logp), weights=cut(inp.weights),
                   seq_ids=inp.seq_ids[start:end], agg=inp.agg[start:end])


def _kl(d: torch.Tensor, kind: str) -> torch.Tensor:
    """KL estimators of d = logp − ref (Schulman's k1/k2/k3); k3 via expm1 for accuracy near 0."""
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    return torch.expm1(-d) + d


def objective_loss(logp: torch.Tensor, entropy: Optional[torch.Tensor], inp: ObjectiveInputs,
                   config: LossConfig):
    """Differentiable loss Σ a_t·ℓ_t from logp [N] (and entropy [N] when α ≠ 0).

    Returns (loss, ratio, kl): ratio and kl are [N] (kl None when β = 0) for the metrics.
    """
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    old = logp.detach() if inp.old_logp is None else inp.old_logp
    # off-mask tokens get log-ratio 0: whatever old_logp holds there cannot reach the loss
    log_ratio = torch.where(inp.on, logp - old, zero)
    if config.ratio_level == "sequence":
        num = torch.zeros(inp.num_seqs, dtype=logp.dtype, device=logp.device).index_add(
            0, inp.seq_ids, log_ratio * inp.mask)
        den = torch.zeros(inp.num_seqs, dtype=logp.dtype, device=logp.device).index_add(
            0, inp.seq_ids, inp.mask)
        log_ratio = (num / positive_or_one(den))[inp.seq_ids]
    ratio = torch.exp(log_ratio)
    adv = inp.advantages
    capped = ratio if config.delta is None else torch.clamp(ratio, max=config.delta)
    clipped = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    obj = torch.minimum(capped * adv, clipped * adv)
    if config.dual_clip_c is not None:
        obj = torch.where(adv < 0, torch.maximum(obj, config.dual_clip_c * adv), obj)
    loss_t = -obj if inp.weights is None else -inp.weights * obj
    kl = None
    if config.beta != 0.0:
        kl = _kl(torch.where(inp.on, logp - inp.ref_logp, zero), config.kl)
        if config.kl_ratio_correction:
            kl = kl * ratio  # ratio before the δ cap, as TRL's use_bias_correction_kl
        loss_t = loss_t + config.beta * kl
    if config.entropy_coef != 0.0:
        loss_t = loss_t - config.entropy_coef * entropy
    return (inp.agg * loss_t).sum(), ratio, kl


def objective_coefficients(logp: torch.Tensor, entropy: Optional[torch.Tensor], inp: ObjectiveInputs,
                           config: LossConfig):
    """(loss, g, h, ratio, kl): loss value and g_t = ∂loss/∂logp_t, h_t = ∂loss/∂H_t ([N], h None
    when α = 0), all detached. For backends that compute the logits gradient themselves."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_(True)
        ent = None
        if config.entropy_coef != 0.0:
            ent = entropy.detach().requires_grad_(True)
        loss, ratio, kl = objective_loss(lp, ent, inp, config)
        grads = torch.autograd.grad(loss, [lp] + ([ent] if ent is not None else []), allow_unused=True)
    g = grads[0] if grads[0] is not None else torch.zeros_like(lp)
    h = grads[1] if ent is not None else None
    return loss.detach(), g.detach(), h, ratio.detach(), None if kl is None else kl.detach()


def objective_metrics(ratio: torch.Tensor, kl: Optional[torch.Tensor], entropy: Optional[torch.Tensor],
                      inp: ObjectiveInputs, config: LossConfig) -> Dict[str, torch.Tensor]:
    """Masked means over completion tokens as 0-d detached float32 tensors, the keys and
    definitions of `reference.loss_metrics` (clip fractions as TRL counts them). Uses no
    data-dependent indexing, so it does not synchronise a GPU stream."""
    m = inp.mask.detach().double()
    cnt = positive_or_one(m.sum())
    r = ratio.detach().double()
    a = inp.advantages.double()
    out = {
        "clip_frac_low": (((r < 1 - config.eps_low) & (a < 0)).double() * m).sum() / cnt,
        "clip_frac_high": (((r > 1 + config.eps_high) & (a > 0)).double() * m).sum() / cnt,
        "ratio_mean": (r * m).sum() / cnt,
    }
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=r.device)
    any_on = inp.on.any()
    one = torch.ones((), dtype=torch.float64, device=r.device)
    out["ratio_min"] = torch.where(any_on, torch.where(inp.on, r, inf).amin() if r.numel() else one, one)
    out["ratio_max"] = torch.where(any_on, torch.where(inp.on, r, -inf).amax() if r.numel() else one, one)
    if config.dual_clip_c is not None:
        out["dual_clip_frac"] = (((a < 0) & (r * a < config.dual_clip_c * a)).double() * m).sum() / cnt
    if kl is not None:
        out["kl_mean"] = (kl.detach().double() * m).sum() / cnt
    if entropy is not None:
        out["entropy_mean"] = (torch.where(inp.on, entropy.detach().double(), 0.0) * m).sum() / cnt
    return {k: v.float() for k, v in out.items()}
