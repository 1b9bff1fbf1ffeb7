"""What one GRPO step reports about its rollouts: rewards (total and per function), accuracy,
completion lengths and truncation, zero-σ groups, the pass-rate histogram, and (multi-turn runs)
the episodes' turns, tool calls and stop reasons; averaged over ranks. Moved out of the metrics
logger (fastgrpo.logs.metrics) because it reduces over ranks, a trainer collective."""
from __future__ import annotations

from typing import Dict

import numpy as np

from fastgrpo.trainer.collectives import all_reduce_metrics


def rollout_metrics(per_fn: Dict[str, object], total, zero_std, groups) -> Dict[str, object]:
    """Reward mean/std (total and per reward function, each [prompts, G]), accuracy, completion
    length mean/max and truncation rate, the fraction of zero-σ groups, and the pass-rate
    histogram (how many prompts had k of G completions correct, k = 0..G); averaged over ranks
    (length max: max over ranks). Collective under several ranks."""
    out = {"reward/mean": float(total.mean()), "reward/std": float(total.std())}
    for name, r in per_fn.items():
        out[f"reward/{name}/mean"] = float(r.mean())
        out[f"reward/{name}/std"] = float(r.std())
    # plain Python over the completions: exact integer sums over n give the same floats as
    # np.mean, without building three arrays a step
    lens = [len(c.token_ids) for g in groups for c in g]
    out["completion/length_mean"] = sum(lens) / len(lens)
    out["completion/length_max"] = float(max(lens))
    out["completion/truncation_rate"] = sum(c.finish_reason == "length" for g in groups for c in g) / len(lens)
    out["train/zero_std_frac"] = float(zero_std.mean())
    if "accuracy" in per_fn:
        out["train/accuracy"] = float(per_fn["accuracy"].mean())
    out.update(episode_metrics(groups))
    out = all_reduce_metrics(out, op="mean", ops={"completion/length_max": "max"})
    if "accuracy" in per_fn:
        g = per_fn["accuracy"].shape[1]
        k = np.rint(per_fn["accuracy"].mean(axis=1) * g).astype(int)
        out["train/pass_rate_hist"] = np.bincount(np.clip(k, 0, g), minlength=g + 1).tolist()
    return out


def episode_metrics(groups) -> Dict[str, float]:
    """Multi-turn runs (fastgrpo.rollout.episodes): per episode means of its model turns, tool calls,
    tool errors / timeouts and unparsable calls, and the share of episodes that ended for each stop
    reason (`episode/stop_<reason>`, every reason present each step so a plot has every series).
    Empty for single-turn rollouts."""
    from fastgrpo.episodes.ledger import STOP_REASONS

    eps = [c.episode for g in groups for c in g if getattr(c, "episode", None) is not None]
    if not eps:
        return {}
    n = len(eps)
    out = {"episode/turns_mean": sum(e.turns for e in eps) / n,
           "episode/tool_calls": sum(e.tool_calls for e in eps) / n,
           "episode/tool_errors": sum(e.tool_errors for e in eps) / n,
           "episode/tool_timeouts": sum(e.tool_timeouts for e in eps) / n,
           "episode/parse_errors": sum(e.parse_errors for e in eps) / n}
    for reason in STOP_REASONS:
        out[f"episode/stop_{reason}"] = sum(e.stop == reason for e in eps) / n
    rewards = [r for e in eps for _, r in e.turn_rewards]
    if rewards:  # an environment that rewards turns (rollout.turn_rewards=dense trains on them)
        out["episode/turn_reward_mean"] = sum(rewards) / len(rewards)
        out["episode/turn_rewards"] = len(rewards) / n
    return out
