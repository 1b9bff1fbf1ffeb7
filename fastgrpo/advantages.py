"""Group-relative advantages for GRPO-family algorithms and their broadcast to packed tokens.

Estimators (rewards of one prompt's G completions form a group, consecutive in `rewards`):
  grpo    DeepSeekMath GRPO: A_i = (r_i − mean) / (σ + eps), σ of the group (scale="group"), of the
          whole batch (scale="batch", TRL's scale_rewards="batch", Hu et al. REINFORCE++) or 1 ("none")
  dr_grpo Dr. GRPO (Liu et al. 2025): A_i = r_i − mean, no σ (the length/difficulty bias fix)
  rloo    RLOO (Ahmadian et al. 2024): A_i = r_i − mean of the other G−1 rewards of the group
  kimi    Kimi k1.5: A_i = r_i − mean, no σ; `baseline="batch"` takes the mean over the whole batch
The baseline of grpo / dr_grpo / kimi is the group mean unless `baseline="batch"`.
Process rewards (fastgrpo/rewards/process.py): `step_advantages` normalises step scores over all
steps of a group (DeepSeekMath's process supervision), added per token to the outcome advantage.
Departure from TRL: a group whose rewards are all equal (σ = 0) gets exactly 0 for every
estimator, instead of (r − mean)/eps, which turns float round-off of the mean into ±1e-12-sized noise.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "kimi")
SCALES = ("group", "batch", "none")
STDS = ("population", "sample")
BASELINES = ("group", "batch")


def _as_groups(rewards, group_size: int) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        try:
            rewards = torch.as_tensor(rewards, dtype=torch.get_default_dtype())
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"rewards: expected a float tensor or a sequence of numbers, got {type(rewards).__name__}") from e
    if rewards.is_complex() or rewards.dtype == torch.bool:
        raise ValueError(f"rewards: expected a real dtype, got {rewards.dtype}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size: expected a positive int (completions per prompt), got {group_size!r}")
    if rewards.dim() == 2:
        if rewards.shape[1] != group_size:
            raise ValueError(f"rewards: a 2-D tensor must be [num_groups, group_size={group_size}], "
                             f"got {tuple(rewards.shape)}")
        flat = rewards.reshape(-1)
    elif rewards.dim() == 1:
        flat = rewards
    else:
        raise ValueError(f"rewards: expected shape [B] or [num_groups, group_size], got {tuple(rewards.shape)}")
    if flat.numel() % group_size != 0:
        raise ValueError(f"rewards: length {flat.numel()} is not a multiple of group_size={group_size} "
                         "(each prompt's completions must be consecutive and complete)")
    # isfinite on the values as given: a float32 / float16 value is finite iff its float64 copy is
    if flat.numel() and not bool(torch.isfinite(flat).all()):
        i = int((~torch.isfinite(flat)).nonzero()[0])
        raise ValueError(f"rewards: non-finite value {float(flat[i])} at index {i}; expected finite rewards "
                         "(score failed verifications as 0 or a penalty)")
    dtype = flat.dtype if flat.dtype.is_floating_point else torch.float32
    return flat.to(dtype).reshape(-1, group_size)


def _std(x: torch.Tensor, std: str, dim=None) -> torch.Tensor:
    n = x.numel() if dim is None else x.shape[dim]
    if std == "sample" and n < 2:
        return torch.zeros(() if dim is None else x.shape[:dim] + x.shape[dim + 1:], dtype=x.dtype, device=x.device)
    correction = 1 if std == "sample" else 0
    return x.std(correction=correction) if dim is None else x.std(dim=dim, correction=correction)


def compute_advantages(rewards: Union[torch.Tensor, Sequence[float]], group_size: int, estimator: str = "grpo",
                       scale: str = "group", std: str = "population", eps: float = 1e-4,
                       baseline: str = "group") -> torch.Tensor:
    """One advantage per completion, the shape of `rewards` ([B] or [num_groups, group_size]).

    `scale` (group | batch | none) picks the σ of the grpo estimator; dr_grpo, rloo and kimi
    never divide by σ. `std` is the population (ddof 0, DeepSeekMath) or sample (ddof 1, TRL)
    standard deviation. Groups with σ = 0 (all rewards equal) give zeros, never NaN.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}: expected one of {ESTIMATORS}")
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}: expected one of {SCALES}")
    if std not in STDS:
        raise ValueError(f"std={std!r}: expected one of {STDS}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline={baseline!r}: expected one of {BASELINES}")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a number >= 0, got {eps!r}")
    shape = rewards.shape if isinstance(rewards, torch.Tensor) else None
    r = _as_groups(rewards, group_size)
    if r.numel() == 0:
        return r.reshape(shape if shape is not None else (0,))
    flat_out = shape is None or len(shape) == 1
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("group_size: rloo needs at least 2 completions per prompt (a leave-one-out baseline)")
        others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
        adv = r - others
    else:
        base = r.mean(dim=1, keepdim=True) if baseline == "group" else r.mean()
        adv = r - base
        if estimator == "grpo" and scale != "none":
            sigma = _std(r, std, dim=1).unsqueeze(1) if scale == "group" else _std(r, std)
            adv = adv / (sigma + eps)
    # σ = 0 groups: exactly zero (a group-mean baseline there is the common value; float round-off
    # of that mean must not become a signal)
    if baseline == "group" or estimator == "rloo":
        adv = adv.masked_fill_((r == r[:, :1]).all(dim=1, keepdim=True), 0.0)  # adv is a fresh tensor
    return adv.reshape(-1) if flat_out else adv


def zero_std_groups(rewards: Union[torch.Tensor, Sequence[float]], group_size: int) -> torch.Tensor:
    """[num_groups] bool: groups whose rewards are all equal (no learning signal; DAPO's dynamic
    sampling drops them)."""
    r = _as_groups(rewards, group_size)
    return (r == r[:, :1]).all(dim=1)


def broadcast_to_tokens(values: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                        lengths: Optional[Union[torch.Tensor, Sequence[int]]] = None) -> torch.Tensor:
    """Per-sequence values [S] → per-token values [N] of the packed layout: sequence i's value on
    tokens cu_seqlens[i]:cu_seqlens[i+1]. Give exactly one of `cu_seqlens` [S+1] or `lengths` [S]."""
    if (cu_seqlens is None) == (lengths is None):
        raise ValueError("cu_seqlens / lengths: give exactly one of cu_seqlens [S+1] or lengths [S]")
    if not isinstance(values, torch.Tensor) or values.dim() != 1:
        raise ValueError(f"values: expected a 1-D tensor [S] (one value per sequence), got "
                         f"{tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__}")
    if cu_seqlens is not None:
        cu = torch.as_tensor(cu_seqlens)
        if cu.dim() != 1 or cu.numel() < 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
            raise ValueError("cu_seqlens: expected a 1-D integer tensor [S+1] of cumulative lengths starting at 0")
        cu = cu.to("cpu", torch.int64)
        if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError("cu_seqlens: must start at 0 and be non-decreasing")
        lens = cu[1:] - cu[:-1]
        name = "cu_seqlens"
    else:
        lens = torch.as_tensor(lengths)
        if lens.dim() != 1 or lens.dtype.is_floating_point or lens.dtype == torch.bool:
            raise ValueError("lengths: expected a 1-D integer tensor or list [S] of sequence lengths")
        lens = lens.to("cpu", torch.int64)
        if bool((lens < 0).any()):
            raise ValueError("lengths: must be >= 0")
        name = "lengths"
    if lens.numel() != values.numel():
        raise ValueError(f"{name}: describes {lens.numel()} sequences but values has {values.numel()}")
    return torch.repeat_interleave(values, lens.to(values.device))


def step_advantages(step_scores: Sequence[Optional[Sequence[float]]], group_size: int, eps: float = 1e-4,
                    credit: str = "step") -> list:
    """Process supervision's step advantages (DeepSeekMath §4.1.3): completions i·G … i·G+G−1
    form a group; every step score s_{j,k} of the group's scored completions (None = not scored:
    no steps, or the scorer failed) is normalised over all of the group's steps,
    Â_{j,k} = (s_{j,k} − mean) / (σ + eps), σ the population standard deviation; a group whose
    step scores are all equal (σ = 0) gets exactly 0, as `compute_advantages` does. `credit`
    "step" keeps Â_{j,k} per step; "to_go" gives step k the sum over its own and every later
    step, Σ_{k' ≥ k} Â_{j,k'} (DeepSeekMath's per-token credit). Returns one float64 array [K_j]
    per completion, or None where it had no scores."""
    import numpy as np

    if credit not in ("step", "to_go"):
        raise ValueError(f"credit={credit!r}: expected 'step' or 'to_go'")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size: expected a positive int (completions per prompt), got {group_size!r}")
    if len(step_scores) % group_size:
        raise ValueError(f"step_scores: length {len(step_scores)} is not a multiple of group_size={group_size}")
    out: list = [None] * len(step_scores)
    scored = [j for j, x in enumerate(step_scores) if x is not None and len(x)]
    if not scored:
        return out
    # every step of the batch at once (groups are consecutive, so are their steps)
    n = np.array([len(step_scores[j]) for j in scored], dtype=np.int64)
    flat = np.fromiter((float(v) for j in scored for v in step_scores[j]), dtype=np.float64, count=int(n.sum()))
    if not np.isfinite(flat).all():
        bad = int(np.repeat(np.array(scored), n)[~np.isfinite(flat)][0])
        raise ValueError(f"step_scores: non-finite step score in group {bad // group_size}; expected finite scores")
    _, grp = np.unique(np.repeat(np.array(scored) // group_size, n), return_inverse=True)
    cnt = np.bincount(grp)
    mean = np.bincount(grp, flat) / cnt
    sigma = np.sqrt(np.bincount(grp, (flat - mean[grp]) ** 2) / cnt)
    starts = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    equal = np.maximum.reduceat(flat, starts) == np.minimum.reduceat(flat, starts)
    adv = np.where(equal[grp], 0.0, (flat - mean[grp]) / (sigma[grp] + eps))
    if credit == "to_go":  # Σ over this step and the later ones of the same completion
        ends = np.cumsum(n)
        total = np.repeat(np.add.reduceat(adv, ends - n), n)
        adv = total - (np.cumsum(adv) - np.repeat(np.cumsum(adv)[ends - 1] - np.add.reduceat(adv, ends - n), n)) + adv
    for j, a in zip(scored, np.split(adv, np.cumsum(n)[:-1])):
        out[j] = a
    return out
