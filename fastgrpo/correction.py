"""Off-policy correction of the GRPO loss: per-token importance weights for rollouts sampled by a
behaviour policy μ that is not the policy π_prox at the start of the update.

Rollouts are off-policy when the engine holds older weights than the trainer (`sync.every > 1`
between syncs; every asynchronous rollout, `rollout.mode=async`, up to η versions behind), and
slightly so even on-policy: the engine's sampling numerics (vLLM kernels, bf16, a decode path)
are not the trainer's (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"). `algorithm.correction` picks how the loss treats them:

- `none`: naive PPO. μ's sampling log-probs are the loss's old log-probs, so the clip is around μ
  (the trust region is measured from a policy up to η versions old). fastgrpo's behaviour
  before this option, and still the default off the async schedule.
- `decoupled`: AReaL's decoupled PPO (Fu et al. 2025, "AReaL: a large-scale asynchronous
  reinforcement learning system for language reasoning", §4; the decoupled objective of Hilton
  et al. 2022). The ratio is r = π_θ/π_prox and the clip is around π_prox (the trust region is
  the update's own), and each token's clipped objective is multiplied by the detached behaviour
  weight w = π_prox/μ. What we follow is AReaL's code (`ppo_actor_loss_fn` with
  `use_decoupled_loss` and `behav_imp_weight_cap`): a token with w > C gets weight 0 (kept iff
  w ≤ C, C > 1) — it is removed from the numerator, while it still counts in the token-mean
  denominator (AReaL divides by the loss mask's count, not by the kept count), so the loss scale
  does not move with how many tokens the cap removes; AReaL applies the cap only when one is
  set, we always set one (`algorithm.is_cap`).
- `tis`: token-level truncated importance sampling (Yao et al. 2025; verl's
  `tis_imp_ratio_cap`): the same proximal clip, weight w = min(π_prox/μ, C), nothing removed.

π_prox at K > 1 is scored by the trainer's no-grad `old_logp` pass before the first inner step. At
K = 1 it is the policy being differentiated, so its detached log-probs are read from the loss
step's own logits (one no-grad log-softmax pass over logits already computed): the same values
as a scoring forward (models without dropout), without a second model forward. The
weights are constant over the K inner steps and reach the loss through the contract's detached
`weights` argument (shared/DESIGN.md, "The loss contract": ℓ_t = −w_t·obj_t + …), which every
backend honours (reference, CPU streaming, fused lm_head, Triton, CCE; tests/kernels' oracle
cases all carry weights).

Defaults and why: `is_cap` C = 2.0, the usual truncation of TIS for the engine–trainer mismatch
(ms-swift's `rollout_importance_sampling_threshold` default; slime's masked-IS band [0.5, 2]):
a token's gradient is at most twice its on-policy size. AReaL's async examples cap the behaviour
weight at 5: a staler buffer (larger η) has more weights far from 1, and a small cap then masks
more of them; raise `algorithm.is_cap` with η. `algorithm.correction=auto`
(the default) means `decoupled` under `rollout.mode=async` — AReaL reports naive PPO losing half
its AIME score at η = 4, and the async schedule is off-policy on every step — and `none` otherwise,
so colocated runs (on-policy: nothing to correct) and `sync.every > 1` runs keep their figures.

Departures: the log-ratio is clamped at ±60 before exp (e^60 ≈ 1e26, above any cap) so that a
token μ found nearly impossible cannot make a weight infinite; weights are computed in float64
and stored float32 like the other per-token inputs. With `none` the metrics describe the raw
ratio π_prox/μ (nothing is truncated), read from the first inner step's own log-probs (= π_prox:
no update applied yet) so that naive PPO costs no extra forward.

Metrics per step (masked-in tokens, summed over micro-batches and ranks before dividing):
`async/mismatch_kl` k3 estimate of KL(μ ‖ π_prox) on the sampled tokens, E_μ[ρ − 1 − log ρ] with
ρ = π_prox/μ; `async/is_ess` (Σw)²/(n·Σw²) ∈ [0, 1], the effective sample size of the weights
as a fraction of the tokens (1: all equal; a cap-masked token counts with w = 0);
`async/is_truncated` the fraction of tokens truncated (tis) or masked (decoupled);
`async/is_weight_mean` the mean weight.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

CORRECTIONS = ("none", "tis", "decoupled")  # what the loss does; the config also accepts "auto"
_MAX_LOG_RATIO = 60.0
_SUM_KEYS = ("n", "w", "w2", "trunc", "kl")


def resolve_correction(kind: str, async_mode: bool) -> str:
    """The correction a run applies: `auto` is `decoupled` on the async schedule, else `none`."""
    if kind == "auto":
        return "decoupled" if async_mode else "none"
    if kind not in CORRECTIONS:
        raise ValueError(f"algorithm.correction={kind!r}: expected auto or one of {list(CORRECTIONS)}")
    return kind


def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, kind: str, cap: float,
                      mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(w [N] float64, truncated [N] bool) of the behaviour ratio ρ = exp(prox − behav).

    decoupled: w = ρ where ρ ≤ cap, else 0 (AReaL's behaviour-weight mask); tis: w = min(ρ, cap);
    none: w = ρ (a diagnostic: the loss takes no weights), nothing truncated. Off-mask tokens
    (mask 0) get w = 0 and are never counted as truncated, whatever their log-probs hold."""
    if kind not in CORRECTIONS:
        raise ValueError(f"kind={kind!r}: expected one of {list(CORRECTIONS)}")
    if not (isinstance(cap, (int, float)) and cap > 1 and math.isfinite(cap)):
        raise ValueError(f"cap={cap!r}: expected a finite number > 1 (algorithm.is_cap)")
    on = torch.ones_like(prox_logp, dtype=torch.bool) if mask is None else mask != 0
    d = torch.where(on, prox_logp.double() - behav_logp.double(), 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho = torch.exp(d)
    if kind == "decoupled":
        trunc = on & (rho > cap)
        w = torch.where(trunc, 0.0, rho)
    elif kind == "tis":
        trunc = on & (rho > cap)
        w = rho.clamp(max=float(cap))
    else:
        trunc = torch.zeros_like(on)
        w = rho
    return torch.where(on, w, 0.0), trunc


def correction_sums(prox_logp: torch.Tensor, behav_logp: torch.Tensor, weights: torch.Tensor,
                    truncated: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """The additive pieces of the metrics over one micro-batch (mask-weighted): token count n,
    Σw, Σw², Σtruncated, Σk3. Add them over micro-batches and ranks, then `correction_metrics`."""
    m = mask.detach().double().cpu()
    d = (prox_logp.detach().double().cpu() - behav_logp.detach().double().cpu())
    d = torch.where(m != 0, d, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    w = weights.detach().double().cpu()
    return {"n": float(m.sum()), "w": float((m * w).sum()), "w2": float((m * w * w).sum()),
            "trunc": float((m * truncated.detach().cpu().double()).sum()),
            "kl": float((m * (torch.expm1(d) - d)).sum())}


def add_sums(total: Dict[str, float], part: Dict[str, float]) -> Dict[str, float]:
    for k in _SUM_KEYS:
        total[k] = total.get(k, 0.0) + part.get(k, 0.0)
    return total


def empty_sums() -> Dict[str, float]:
    return {k: 0.0 for k in _SUM_KEYS}


def correction_metrics(sums: Dict[str, float]) -> Dict[str, float]:
    """`async/*` metrics of summed pieces; {} when no token was counted."""
    n = sums.get("n", 0.0)
    if n <= 0:
        return {}
    w, w2 = sums["w"], sums["w2"]
    return {"async/mismatch_kl": sums["kl"] / n,
            "async/is_ess": (w * w) / (n * w2) if w2 > 0 else 0.0,
            "async/is_truncated": sums["trunc"] / n,
            "async/is_weight_mean": w / n}


def apply_correction(batch, kind: str, cap: float) -> Dict[str, float]:
    """Set `batch.weights` to the correction's weights from `batch.old_logp` (π_prox, scored) and
    `batch.behav_logp` (μ) — multiplied into weights the batch already carries — and return
    this micro-batch's metric sums. `kind` is tis or decoupled (none weights nothing)."""
    if kind not in ("tis", "decoupled"):
        raise ValueError(f"kind={kind!r}: expected tis or decoupled (none applies no weights)")
    if batch.old_logp is None or batch.behav_logp is None:
        raise ValueError("apply_correction: the batch needs old_logp (π_prox, scored by the trainer) and "
                         "behav_logp (the engine's sampling log-probs)")
    batch.weights, sums = proximal_weights(batch.old_logp, batch.behav_logp, batch.loss_mask, kind, cap, batch.weights)
    return sums


def proximal_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, kind: str, cap: float,
                     weights: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """(float32 weights [N] for the loss — the correction's, times `weights` when given —, metric
    sums) from π_prox and μ log-probs; `kind` tis or decoupled."""
    w, trunc = behaviour_weights(prox_logp, behav_logp, kind, cap, mask)
    sums = correction_sums(prox_logp, behav_logp, w, trunc, mask)
    w = w.to(torch.float32)
    return (w if weights is None else weights * w), sums
