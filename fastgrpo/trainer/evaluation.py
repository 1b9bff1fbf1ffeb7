"""Held-out evaluation: accuracy and pass@k with the rollout engine.

`eval/accuracy` is the mean accuracy reward over all samples (greedy when eval.temperature = 0,
the usual R1-style pass@1 when sampling); `eval/pass@n` is the fraction of problems with at least
one correct sample (accuracy reward > 0) among their n = eval.num_samples samples; for each k in
eval.pass_k (k ≤ n), `eval/pass@k` is Chen et al. (2021)'s unbiased estimator from the same n
samples, the mean over problems of 1 − C(n − c, k) / C(n, k) with c correct samples (at k = n it
is the plain fraction above).

Accuracy is the task's verifier (`Rewards.verifier`) whatever the run trains on: a run whose
rewards are only the user's own is still measured by the task's answers. A task with no verifier
evaluates what it can — `eval/length_mean`, `eval/truncated`, each training reward's mean
(`eval/reward/<name>`) — and says so once; its result has no `eval/accuracy`.

Multi-turn runs evaluate whole episodes, tools included, and also log how the held-out episodes
used them (`eval/episode/tool_calls`, `…/turns_mean`, `…/stop_<reason>`, the training step's
`episode/` metrics); eval_samples.jsonl shows each episode turn by turn.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Sequence

import numpy as np

from fastgrpo.trainer.build import sampling_config
from fastgrpo.config import EvalConfig, RolloutConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 − C(n−c, k)/C(n, k), computed as
    1 − Π_{i=n−c+1..n} (1 − k/i) (no large binomials)."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)) or not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k(n={n!r}, c={c!r}, k={k!r}): expected integers with 0 <= c <= n and 1 <= k <= n")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _verifier(reward_fns):
    """The task's accuracy: `Rewards.verifier` (fastgrpo.rewards.registry), which is the task's
    verifier whatever the training rewards are; a plain mapping's 'accuracy'; None when neither."""
    if hasattr(reward_fns, "verifier"):
        return reward_fns.verifier
    try:
        return reward_fns["accuracy"] if "accuracy" in reward_fns else None
    except TypeError:
        return None


def _no_verifier(reward_fns, log) -> None:
    """Say once per set of rewards that held-out accuracy cannot be measured."""
    if getattr(reward_fns, "_said_no_verifier", False):
        return
    log("[fastgrpo] held-out evaluation: the task has no verifier (no 'accuracy' reward), so eval/accuracy and "
        "pass@k are not measured; logged instead: eval/length_mean, eval/truncated and each training reward's mean "
        "(eval/reward/<name>)")
    try:
        reward_fns._said_no_verifier = True
    except AttributeError:  # a plain dict: said every time
        pass


def _mean_score(fn, inputs) -> float:
    """A training reward's mean on the held-out completions (None and non-numbers as 0; a reward
    that raises gives NaN: a held-out evaluation never stops a run)."""
    from fastgrpo.rewards.faults import check_score
    from fastgrpo.rewards.registry import call_reward

    try:
        vals = [check_score(v)[0] for v in call_reward(fn, inputs)]
    except Exception:  # noqa: BLE001 — the training path reports this reward's failures
        return float("nan")
    return float(np.mean([0.0 if v is None else v for v in vals])) if vals else 0.0


@contextlib.contextmanager
def _problem_bar(engine, n_problems: int, k: int, enabled: bool):
    """A tqdm bar over `n_problems` fed by the engine's `progress` hook (completions finished;
    k per problem, a problem's k are consecutive), removed when the evaluation ends."""
    if not enabled or not hasattr(engine, "progress"):
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=n_problems, desc="eval", unit="problem", dynamic_ncols=True, leave=False)
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        bar.update(min(done[0] // k, n_problems) - bar.n)

    engine.progress = tick
    try:
        yield
    finally:
        engine.progress = None
        bar.close()


def evaluate(engine, problems: Sequence, reward_fns, ecfg: EvalConfig, rcfg: RolloutConfig,
             log=print, progress: bool = False) -> Dict[str, float]:
    """Held-out accuracy, pass@k and the training rewards' means on `problems`. `progress`: a bar
    over the problems while the engine samples (a first evaluation of 200 problems on SmolLM2 ran
    for minutes without a word, issue 34)."""
    if not problems:
        raise ValueError("problems: the held-out split is empty (data.num_heldout = 0 or no eval_path); nothing to evaluate")
    verifier = _verifier(reward_fns)
    problems = list(problems)[: ecfg.max_problems]
    k = ecfg.num_samples
    sampling = sampling_config(rcfg, temperature=ecfg.temperature, seed=1234 if ecfg.temperature > 0 else None)
    runner = getattr(engine, "episodes", None)  # multi-turn: held-out episodes run with their tools too
    if runner is not None:
        ids = engine.tokenizer([p.prompt for p in problems], add_special_tokens=False)["input_ids"]
        groups = runner.run(problems, ids, k, sampling)
    else:
        with _problem_bar(engine, len(problems), k, progress):
            groups = engine.generate([p.prompt for p in problems], n=k, sampling=sampling)
    from fastgrpo.rewards.registry import RewardInputs, call_reward

    comps = [c for g in groups for c in g]
    inputs = RewardInputs(completions=[c.text for c in comps], problems=[p for p in problems for _ in range(k)],
                          lengths=[len(c.token_ids) for c in comps],
                          truncated=[getattr(c, "finish_reason", "stop") == "length" for c in comps],
                          completion_ids=[list(c.token_ids) for c in comps], group_size=k)
    out = {"eval/num_problems": float(len(problems))}
    if verifier is not None:
        acc = np.asarray([0.0 if v is None else float(v) for v in call_reward(verifier, inputs)]).reshape(-1, k)
        out.update({"eval/accuracy": float(acc.mean()), f"eval/pass@{k}": float((acc.max(axis=1) > 0).mean())})
        correct = (acc > 0).sum(axis=1)
        for kk in getattr(ecfg, "pass_k", ()) or ():
            if not 1 <= kk <= k:
                raise ValueError(f"eval.pass_k: {kk} is not in [1, eval.num_samples={k}]")
            out[f"eval/pass@{kk}"] = float(np.mean([pass_at_k(k, int(c), int(kk)) for c in correct]))
    else:
        _no_verifier(reward_fns, log)
        acc = np.full((len(problems), k), np.nan)  # no verifier score for any completion
        for name in list(getattr(reward_fns, "keys", lambda: ())()):
            out[f"eval/reward/{name}"] = _mean_score(reward_fns[name], inputs)
    if "format" in reward_fns:
        out["eval/format"] = float(np.mean([0.0 if v is None else float(v) for v in call_reward(reward_fns["format"], inputs)]))
    out["eval/length_mean"] = float(np.mean([len(c.token_ids) for g in groups for c in g]))
    # completions cut by the cap: a held-out accuracy with many of them measures the cap, not the model
    out["eval/truncated"] = float(np.mean(inputs.truncated)) if comps else 0.0
    from fastgrpo.trainer.step_metrics import episode_metrics

    # multi-turn: how the held-out episodes used their tools (eval/episode/tool_calls, …/stop_<reason>)
    out.update({f"eval/{k}": v for k, v in episode_metrics(groups).items()})
    from fastgrpo.logs.samples import EvalResult, eval_rows

    # a dict as before, carrying every completion with its score: the run's logger writes them
    # to eval_samples.jsonl beside the accuracy (MetricsLogger.log)
    return EvalResult(out, eval_rows(problems, groups, acc))
