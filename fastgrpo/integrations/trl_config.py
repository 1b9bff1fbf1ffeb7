"""TRL's GRPOConfig in terms of fastgrpo's loss contract: which `LossConfig`, token count and
scale reproduce one `GRPOTrainer._compute_loss` micro-batch (TRL 1.16). Importable without TRL
installed (the drop-in itself, fastgrpo.integrations.trl, needs it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fastgrpo.kernels.contract import LossConfig


@dataclass(frozen=True)
class TrlLossSpec:
    """How to reproduce one TRL GRPOTrainer micro-batch loss: grpo_loss(..., config=config,
    num_items=num_items) * loss_scale equals TRL's `_compute_loss` on the same tokens."""

    config: LossConfig  # the loss contract's settings for this TRL loss_type
    num_items: Optional[float]  # token-mean denominator (TRL dapo's normalizer), else None
    loss_scale: float  # multiply our loss by it: 1/gradient_accumulation_steps where TRL divides


_TRL_AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
            "dapo": "token-mean"}


def trl_loss_config(loss_type: str = "dapo", *, epsilon: float = 0.2, epsilon_high: Optional[float] = None,
                    delta: Optional[float] = None, beta: float = 0.0, use_bias_correction_kl: bool = True,
                    importance_sampling_level: str = "token", temperature: float = 1.0,
                    max_completion_length: Optional[int] = None, entropy_coef: float = 0.0,
                    num_items_in_batch=None, num_processes: int = 1, gradient_accumulation_steps: int = 1,
                    steps_per_generation: Optional[int] = None, training: bool = True) -> TrlLossSpec:
    """Map TRL 1.16 GRPOConfig arguments (and the per-step `num_items_in_batch`) to our contract.

    Follows GRPOTrainer._compute_loss: ε_low = epsilon, ε_high = epsilon_high or epsilon; k3 KL;
    grpo → seq-mean-token-mean, bnpo → token-mean, dr_grpo → Σ/(B·max_completion_length),
    dapo → Σ/(num_items_in_batch / num_processes · GA / steps_per_generation). TRL divides grpo,
    bnpo and dr_grpo by the accumulation steps in training: that is `loss_scale`. The vLLM
    importance-sampling ratio maps to `weights`. TRL's entropy bonus is a plain masked token mean
    whatever the loss type, which our contract reproduces only for bnpo: other types raise.
    """
    if loss_type not in _TRL_AGG:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {tuple(_TRL_AGG)} (TRL loss types with the "
                         "clipped-ratio objective)")
    if entropy_coef != 0.0 and loss_type != "bnpo":
        raise ValueError(f"entropy_coef={entropy_coef}: TRL adds its entropy bonus as a masked token mean, which "
                         f"loss_type={loss_type!r} aggregates differently; only 'bnpo' matches exactly")
    for name, v in (("num_processes", num_processes), ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    ga = gradient_accumulation_steps if training else 1
    spg = gradient_accumulation_steps if steps_per_generation is None else steps_per_generation
    num_items = None
    scale = 1.0 / ga
    if loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("num_items_in_batch: required for loss_type='dapo' (TRL's global completion-token count)")
        num_items = max(float(num_items_in_batch), 1.0) / num_processes
        if training:
            num_items = num_items * gradient_accumulation_steps / spg
        scale = 1.0
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("max_completion_length: required for loss_type='dr_grpo' (its L_max)")
    config = LossConfig(temperature=temperature, eps_low=epsilon,
                        eps_high=epsilon if epsilon_high is None else epsilon_high, delta=delta, beta=beta,
                        kl="k3", kl_ratio_correction=bool(use_bias_correction_kl and beta != 0.0),
                        entropy_coef=entropy_coef, ratio_level=importance_sampling_level,
                        loss_agg=_TRL_AGG[loss_type],
                        max_len=max_completion_length if loss_type == "dr_grpo" else None)
    return TrlLossSpec(config=config, num_items=num_items, loss_scale=scale)
