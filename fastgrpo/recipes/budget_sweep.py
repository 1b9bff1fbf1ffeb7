"""Thinking-budget sweep (Qwen3 technical report, §4.3 and its thinking-budget scaling figure):
greedy held-out accuracy in thinking and non-thinking mode at a list of budgets.

A budget is a fraction of the full thinking budget B (`fusion.full_budget`, else the longest
think span — tokens up to and including `rollout.think_end` — of the RL model's verified traces):
b = round(f·B) tokens. At b >= 1 the engine's own thinking budget runs (fastgrpo/rollout/base.py:
after b tokens without think_end the interrupt string `rollout.interrupt` is forced, then at most
`rollout.answer_budget` tokens more); at b = 0 `fusion.think_start` + the interrupt are forced at
once and only the answer is generated. Per (mode, fraction) the sweep reports accuracy (the
task's accuracy reward), the mean / max number of sampled think tokens (before think_end or the
interrupt: never more than b), the fraction interrupted, the fraction whose think span the model
closed itself empty (a direct answer; an interrupted one never counts) and the mean completion
length. Departure from Qwen3: its curves are sampled
pass@1 over several runs; this is one greedy pass (deterministic, comparable before / after).
"""
from __future__ import annotations

import csv
import math
import os
from typing import Dict, List, Sequence

import numpy as np

FIELDS = ("stage", "mode", "fraction", "budget", "accuracy", "think_tokens_mean", "think_tokens_max",
          "interrupted", "empty_think", "length_mean", "num_problems")


def score(reward_fns, problems: Sequence, comps: Sequence, name: str) -> List[float]:
    """Reward `name` of `reward_fns` for completions `comps` of `problems` (None scores 0)."""
    from fastgrpo.rewards.registry import RewardInputs, call_reward

    inputs = RewardInputs(completions=[c.text for c in comps], problems=list(problems),
                          lengths=[len(c.token_ids) for c in comps],
                          truncated=[c.finish_reason == "length" for c in comps],
                          completion_ids=[list(c.token_ids) for c in comps], group_size=1)
    return [0.0 if v is None else float(v) for v in call_reward(reward_fns[name], inputs)]


def full_budget_of(traces: Sequence, configured: int = 0) -> int:
    """B: `configured` when set, else the longest think span of `traces` (at least 1)."""
    return configured if configured > 0 else max(1, max(t.think_tokens for t in traces))


def budgets(fractions: Sequence[float], full: int) -> List[int]:
    bad = [x for x in fractions if not (isinstance(x, (int, float)) and 0 <= x <= 1)]
    if bad:
        raise ValueError(f"fusion.budget_fractions={list(fractions)!r}: {bad[0]!r} is not a fraction in [0, 1]")
    return [int(math.floor(x * full + 0.5)) for x in fractions]


def _find(seq: Sequence[int], sub: Sequence[int]) -> int:
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if list(seq[i:i + n]) == list(sub):
            return i
    return -1


def think_tokens(c, end_ids: Sequence[int]) -> int:
    """Sampled tokens of a completion before its think_end or its first forced token."""
    stop = len(c.token_ids)
    k = _find(c.token_ids, end_ids) if end_ids else -1
    if k >= 0:
        stop = k
    forced = next((i for i, m in enumerate(c.sampled_mask) if not m), -1)
    if forced >= 0:
        stop = min(stop, forced)
    return sum(1 for m in c.sampled_mask[:stop] if m)


def _generate(engine, prompt_ids: List[List[int]], cfg, budget: int, closed_in_prompt: bool):
    from fastgrpo.rollout.base import DEFAULT_INTERRUPT, Completion, SamplingConfig

    r, f = cfg.rollout, cfg.fusion
    interrupt = r.interrupt or DEFAULT_INTERRUPT
    if closed_in_prompt:  # the template closed the reasoning in the prompt: nothing for a budget to cut
        s = SamplingConfig(temperature=0.0, max_new_tokens=r.max_new_tokens, stop=tuple(r.stop))
        return [g[0] for g in engine.generate(prompt_ids, n=1, sampling=s)]
    if budget >= 1:
        s = SamplingConfig(temperature=0.0, max_new_tokens=budget + r.answer_budget, stop=tuple(r.stop),
                           thinking_budget=budget, answer_budget=r.answer_budget, think_end=r.think_end,
                           interrupt=interrupt)
        return [g[0] for g in engine.generate(prompt_ids, n=1, sampling=s)]
    tok = engine.tokenizer
    forced = tok(f.think_start + interrupt, add_special_tokens=False)["input_ids"]
    s = SamplingConfig(temperature=0.0, max_new_tokens=r.answer_budget, stop=tuple(r.stop))
    outs = [g[0] for g in engine.generate([p + forced for p in prompt_ids], n=1, sampling=s)]
    return [Completion(token_ids=forced + c.token_ids, logprobs=[0.0] * len(forced) + c.logprobs,
                       finish_reason=c.finish_reason, sampled_mask=[0] * len(forced) + c.sampled_mask,
                       text=tok.decode(forced + c.token_ids, skip_special_tokens=True)) for c in outs]


def run_sweep(engine, problems: Sequence, reward_fns, switch, cfg, full_budget: int) -> List[Dict[str, float]]:
    """One row per (mode, fraction of fusion.budget_fractions), see the module docstring."""
    f, r = cfg.fusion, cfg.rollout
    if not problems:
        raise ValueError("fusion: the budget sweep needs held-out problems; the held-out split is empty")
    problems = list(problems)[: cfg.eval.max_problems]
    tok = engine.tokenizer
    end_ids = tok(r.think_end, add_special_tokens=False)["input_ids"]
    rows = []
    for mode in ("think", "no_think"):
        thinking = mode == "think"
        prompt_ids = [tok(switch.prompt(p.prompt, thinking), add_special_tokens=False)["input_ids"] for p in problems]
        closed = not thinking and switch.uses_template_switch and not switch.no_think_prefix
        for frac, b in zip(f.budget_fractions, budgets(f.budget_fractions, full_budget)):
            comps = _generate(engine, prompt_ids, cfg, b, closed)
            acc = score(reward_fns, problems, comps, "accuracy")
            thinks = [0 if closed and r.think_end not in c.text else think_tokens(c, end_ids) for c in comps]
            empty = []
            for c in comps:
                if r.think_end not in c.text:
                    empty.append(closed)
                    continue
                span = c.text.split(r.think_end, 1)[0].replace(f.think_start, "", 1)
                empty.append(not span.strip() and 0 not in c.sampled_mask)  # closed by the model, not the interrupt
            rows.append({"mode": mode, "fraction": float(frac), "budget": int(b), "accuracy": float(np.mean(acc)),
                         "think_tokens_mean": float(np.mean(thinks)), "think_tokens_max": int(max(thinks)),
                         "interrupted": float(np.mean([0 in c.sampled_mask for c in comps])),
                         "empty_think": float(np.mean(empty)),
                         "length_mean": float(np.mean([len(c.token_ids) for c in comps])),
                         "num_problems": len(problems)})
    return rows


def write_sweep(folder: str, before: Sequence[Dict], after: Sequence[Dict]) -> None:
    """budget_sweep.json ({"before": rows, "after": rows}) and budget_sweep.csv in `folder`."""
    import json

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "budget_sweep.json"), "w") as fh:
        json.dump({"before": list(before), "after": list(after)}, fh, indent=1)
    with open(os.path.join(folder, "budget_sweep.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        for stage, rows in (("before", before), ("after", after)):
            for row in rows:
                w.writerow({"stage": stage, **row})


def plot_sweep(path: str, before: Sequence[Dict], after: Sequence[Dict]) -> bool:
    """Accuracy against the thinking budget, one line per (stage, mode); False without matplotlib."""
    try:
        import matplotlib
    except ImportError:  # plots are optional (the dev extra); the JSON / CSV remain
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    colors = {"think": "tab:blue", "no_think": "tab:orange"}
    for stage, rows, style in (("before fusion", before, ":"), ("after fusion", after, "-")):
        for mode in ("think", "no_think"):
            pts = sorted((x["fraction"], x["accuracy"]) for x in rows if x["mode"] == mode)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=colors[mode],
                        label=f"{mode}, {stage}")
    full = max((x["budget"] for x in list(after) + list(before)), default=0)
    ax.set_xlabel(f"thinking budget (fraction of {full} tokens)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("thinking-mode fusion: accuracy against the thinking budget")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
