"""Held-out evaluation: accuracy and pass@k with the rollout engine.

`eval/accuracy` is the mean accuracy reward over all samples (greedy when eval.temperature = 0,
the usual R1-style pass@1 when sampling); `eval/pass@k` is the fraction of problems with at least
one correct sample among k = eval.num_samples (the plain estimator: n = k, Chen et al. 2021's
unbiased estimator reduces to it).
"""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

from .builders import sampling_config
from .config import EvalConfig, RolloutConfig


def evaluate(engine, problems: Sequence, reward_fns, ecfg: EvalConfig, rcfg: RolloutConfig) -> Dict[str, float]:
    if not problems:
        raise ValueError("problems: the held-out split is empty (data.num_heldout = 0 or no eval_path); nothing to evaluate")
    if "accuracy" not in reward_fns:
        raise ValueError(f"reward_fns: evaluation needs an 'accuracy' reward, the task has {sorted(reward_fns)}")
    problems = list(problems)[: ecfg.max_problems]
    k = ecfg.num_samples
    sampling = sampling_config(rcfg, temperature=ecfg.temperature, seed=1234 if ecfg.temperature > 0 else None)
    groups = engine.generate([p.prompt for p in problems], n=k, sampling=sampling)
    texts = [c.text for g in groups for c in g]
    answers = [p.answer for p in problems for _ in range(k)]
    acc = np.asarray([0.0 if v is None else float(v) for v in reward_fns["accuracy"](texts, answers)]).reshape(-1, k)
    out = {"eval/accuracy": float(acc.mean()), f"eval/pass@{k}": float((acc.max(axis=1) > 0).mean()),
           "eval/num_problems": float(len(problems))}
    if "format" in reward_fns:
        out["eval/format"] = float(np.mean([0.0 if v is None else float(v) for v in reward_fns["format"](texts, answers)]))
    out["eval/length_mean"] = float(np.mean([len(c.token_ids) for g in groups for c in g]))
    return out
