"""Reward composition: a weighted sum of named rewards, each logged separately, and the
`RewardManager` a trainer holds for the whole run (one persistent pool, closed at the end).

As in TRL's GRPOTrainer (`reward_funcs` + `reward_weights`, per-function metrics) with two
departures: a None (unverifiable: a data error, a parse failure) in any component is never a
silent 0 — it makes the total None (the default: the caller skips the sample) or, with
`none_score`, scores that number (the trainer's `rewards.error_score`); and each component's
reason codes become metrics. `score_groups` is the trainer's scoring path over a rollout batch
and mixes through `combine_rewards`, so both follow the one rule; it also applies the one rule
for failures (fastgrpo/rewards/faults.py: a raise, a timeout or a value that is no real number
fails those completions, one line per reward) — where TRL turns a None into NaN and lets NaN and
strings reach the advantages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from fastgrpo.rewards.code import code_reward
from fastgrpo.rewards.format import format_reward
from fastgrpo.rewards.language import language_reward
from fastgrpo.rewards.length import KimiLengthGate, kimi_length_reward, overlong_penalty
from fastgrpo.rewards.math import math_reward
from fastgrpo.rewards.sandbox.pool import RewardPool
from fastgrpo.rewards.reasons import reason_counts


@dataclass
class CombinedReward:
    total: List[Optional[float]]  # weighted sum per sample; None where a component is None
    components: Dict[str, List[Optional[float]]]  # each named reward, unweighted
    metrics: Dict[str, float] = field(default_factory=dict)  # reward/<name>/mean, reason shares


def combine_rewards(components: Mapping[str, Sequence[Optional[float]]], weights: Optional[Mapping[str, float]] = None,
                    reasons: Optional[Mapping[str, Sequence[Optional[str]]]] = None,
                    none_score: Optional[float] = None) -> CombinedReward:
    """Weighted sum of named per-sample rewards (weight 1.0 for names missing from `weights`).
    A None component makes that sample's total None, or counts as `none_score` when one is given
    (the component lists keep their None; `reward/<name>/none_frac` counts them either way)."""
    if not components:
        raise ValueError("components: expected at least one named reward list")
    weights = dict(weights or {})
    unknown = set(weights) - set(components)
    if unknown:
        raise ValueError(f"weights: names {sorted(unknown)} have no component; components are {sorted(components)}")
    n = {len(v) for v in components.values()}
    if len(n) != 1:
        raise ValueError(f"components: expected equal lengths, got { {k: len(v) for k, v in components.items()} }")
    size = n.pop()
    total: List[Optional[float]] = [0.0] * size
    metrics: Dict[str, float] = {}
    for name, vals in components.items():
        w = float(weights.get(name, 1.0))
        ok = [v for v in vals if v is not None]
        if ok:
            metrics[f"reward/{name}/mean"] = sum(ok) / len(ok)
        metrics[f"reward/{name}/none_frac"] = (size - len(ok)) / size if size else 0.0
        for i, v in enumerate(vals):
            if v is None and none_score is not None:
                v = none_score
            if v is None or total[i] is None:
                total[i] = None
            else:
                total[i] += w * float(v)
        if reasons and name in reasons:
            metrics.update(reason_counts(reasons[name], f"reward/{name}"))
    ok = [t for t in total if t is not None]
    if ok:
        metrics["reward/total/mean"] = sum(ok) / len(ok)
    return CombinedReward(total, {k: list(v) for k, v in components.items()}, metrics)


def score_groups(problems: Sequence, groups: Sequence, fns: Mapping[str, Callable], names: Sequence[str],
                 weights: Sequence[float], error_score: float = 0.0, on_error: str = "zero", step: int = 0,
                 faults=None) -> Tuple[Dict[str, "np.ndarray"], "np.ndarray", set, List[str]]:
    """A rollout batch's rewards: (per reward [B, G] unweighted, the weighted total [B, G],
    indices of groups to drop, error lines — at most one per reward).

    `problems[i]` is the task's problem (`.id`, `.answer`, …); `groups[i]` holds its G completions
    (`.text`, `.token_ids`, `.finish_reason`). Each reward `fns[name]` is called once on the whole
    batch with a `fastgrpo.rewards.registry.RewardInputs` (or, in the older signature, as
    `fn(texts, answers)`), in the order of `names`, and sees the scores of the rewards before it
    (`inputs.scores`); verifiers amortise their start-up that way. Only when that call raises (or
    returns no list of B·G values) is it re-run prompt by prompt, so that the failing prompt's id
    is reported and only that group fails; a call that times out (`RewardTimeout`) is not re-run
    (its wait would be paid again per prompt). A value that is no score (fastgrpo.rewards.faults:
    a bool, a string, NaN, ±inf, beyond ±1e9) fails that completion only, and a reward may report
    failed items itself (`drain_item_errors()`, the process reward). A failed completion scores
    `error_score` (on_error="zero") or drops its group (on_error="drop"); a None score
    (unverifiable) counts as `error_score` (`combine_rewards(..., none_score=error_score)`). Each
    reward with failures gets one error line naming the first failure's prompt id and the count;
    `faults` (a `RewardFaults`) receives the counts.
    """
    import numpy as np  # here, not at import: the sandbox imports fastgrpo.rewards in a bare interpreter

    from fastgrpo.rewards.faults import BadScores, check_scores
    from fastgrpo.rewards.registry import RewardInputs, call_reward
    from fastgrpo.rewards.worker import RewardTimeout, describe

    B = len(problems)
    G = len(groups[0]) if B else 0
    comps = [c for g in groups for c in g]
    inputs = RewardInputs(completions=[c.text for c in comps], problems=[p for p in problems for _ in range(G)],
                          lengths=[len(getattr(c, "token_ids", ()) or ()) for c in comps],
                          truncated=[getattr(c, "finish_reason", "stop") == "length" for c in comps],
                          completion_ids=[list(getattr(c, "token_ids", ()) or ()) for c in comps],
                          group_size=G, step=step,
                          episodes=[getattr(c, "episode", None) for c in comps])
    raw: Dict[str, List[Optional[float]]] = {}
    dropped: set = set()
    errors: List[str] = []
    if faults is not None:
        faults.begin_round(names, B * G)
    key = lambda i: getattr(problems[i], "key", "") or problems[i].id  # noqa: E731
    for name in names:
        fn = fns[name]
        failed: Dict[int, str] = {}  # completion index → why
        timeouts = 0
        try:
            scores, bad = check_scores(call_reward(fn, inputs), B * G, name)
            failed.update(bad)
        except RewardTimeout as e:
            scores, timeouts = [None] * (B * G), 1
            failed.update({j: describe(e) for j in range(B * G)})
        except Exception:  # noqa: BLE001 — retried prompt by prompt below, which reports it
            scores = [None] * (B * G)
            for i in range(B):
                lo, hi = i * G, (i + 1) * G
                if timeouts:  # an earlier prompt's call timed out: the rest are not tried
                    failed.update({j: "not scored: an earlier call of this step timed out" for j in range(lo, hi)})
                    continue
                try:
                    scores[lo:hi], bad = check_scores(call_reward(fn, inputs.slice(lo, hi)), G, name)
                    failed.update({lo + j: why for j, why in bad.items()})
                except RewardTimeout as e:  # noqa: PERF203
                    timeouts = 1
                    failed.update({j: describe(e) for j in range(lo, hi)})
                except BadScores as e:
                    failed.update({j: str(e) for j in range(lo, hi)})
                except Exception as e:  # noqa: BLE001 — reported, never fatal: one bad verifier call must not kill a run
                    failed.update({j: f"raised {describe(e)}" for j in range(lo, hi)})
        drain = getattr(fn, "drain_item_errors", None)
        if callable(drain):
            for j, why in drain().items():
                failed.setdefault(j, why)
        for j in failed:
            scores[j] = error_score
        if failed:
            first = min(failed)
            i = first // G if G else 0
            what = "its group dropped" if on_error == "drop" else "scored rewards.error_score"
            line = (f"reward {name!r} on prompt id {key(i)}: {failed[first]} (completion {first % G if G else 0}); "
                    f"{what} — {len(failed)} of {B * G} completions failed this step")
            n_prompts = len({j // G for j in failed}) if G else 0
            errors.append(line + (f" (on {n_prompts} prompts)" if n_prompts > 1 else ""))
            if on_error == "drop":
                dropped.update(j // G for j in failed)
            if faults is not None:
                faults.record(name, len(failed), f"prompt id {key(i)}: {failed[first]}", timeouts)
        raw[name] = scores
        inputs.scores[name] = scores
    mixed = combine_rewards(raw, dict(zip(names, weights)), none_score=error_score) if names else None
    per_fn = {k: np.array([error_score if v is None else v for v in vals], dtype=np.float64).reshape(B, G)
              for k, vals in raw.items()}
    total = (np.array(mixed.total, dtype=np.float64).reshape(B, G) if mixed is not None
             else np.zeros((B, G), dtype=np.float64))
    return per_fn, total, dropped, errors


_BUILTIN = ("math", "code", "format", "kimi_length", "overlong", "language")


class RewardManager:
    """What a trainer holds: named built-in rewards with weights and options, one persistent
    RewardPool. `score(...)` → CombinedReward; `close()` (or `with`) at the end of training.

    weights: {name: weight} over math, code, format, kimi_length, overlong, language.
    options: {name: kwargs} passed to that reward (e.g. {"overlong": {"max_length": 1024,
        "cache_length": 256}}, {"math": {"timeout": 3.0}}).
    correctness: which reward decides "correct" for kimi_length (score ≥ 1.0).
    """

    def __init__(self, weights: Mapping[str, float], options: Optional[Mapping[str, dict]] = None,
                 pool: Optional[RewardPool] = None, num_workers: Optional[int] = None, correctness: str = "math",
                 kimi_gate: Optional[KimiLengthGate] = None):
        bad = [k for k in weights if k not in _BUILTIN]
        if bad:
            raise ValueError(f"weights: unknown rewards {bad}; expected names among {list(_BUILTIN)}")
        bad = [k for k in (options or {}) if k not in weights or k == "kimi_length"]
        if bad:
            raise ValueError(f"options: {bad} must name weighted rewards among {[k for k in weights if k != 'kimi_length']}"
                             " (kimi_length is configured through kimi_gate)")
        if correctness not in ("math", "code"):
            raise ValueError(f"correctness={correctness!r}: expected 'math' or 'code'")
        self.weights, self.options = dict(weights), {k: dict(v) for k, v in (options or {}).items()}
        self.correctness = correctness
        self.kimi_gate = kimi_gate or KimiLengthGate()
        self._own_pool = pool is None
        self.pool = pool or RewardPool(num_workers=num_workers)

    def score(self, completions: Sequence[str], *, answers: Optional[Sequence[str]] = None,
              tests: Optional[Sequence[str]] = None, lengths: Optional[Sequence[int]] = None,
              groups: Optional[Sequence] = None, step: Optional[int] = None) -> CombinedReward:
        comps: Dict[str, List] = {}
        why: Dict[str, List] = {}

        def need(value, what, name):
            if value is None:
                raise ValueError(f"{what}: required by the {name!r} reward")
            return value

        names = list(self.weights)
        if "kimi_length" in names and self.correctness not in names:
            names.insert(0, self.correctness)
        for name in names:
            opt = self.options.get(name, {})
            if name == "math":
                comps[name], why[name] = math_reward(completions, need(answers, "answers", name), pool=self.pool,
                                                     return_reasons=True, **opt)
            elif name == "code":
                comps[name], why[name] = code_reward(completions, need(tests, "tests", name), pool=self.pool,
                                                     return_reasons=True, **opt)
            elif name == "format":
                comps[name], why[name] = format_reward(completions, return_reasons=True, **opt)
            elif name == "language":
                comps[name], why[name] = language_reward(completions, return_reasons=True, **opt)
            elif name == "overlong":
                comps[name] = overlong_penalty(need(lengths, "lengths", name), **opt)
        if "kimi_length" in self.weights:
            correct = [s is not None and s >= 1.0 for s in comps[self.correctness]]
            comps["kimi_length"] = kimi_length_reward(need(lengths, "lengths", "kimi_length"), correct, groups=groups,
                                                      gate=self.kimi_gate, step=step)
        weights = {k: self.weights.get(k, 0.0) for k in comps}
        out = combine_rewards(comps, weights, why)
        out.metrics["reward/kimi_length/active"] = float(self.kimi_gate.active)
        return out

    def state_dict(self) -> dict:
        return {"kimi_gate": self.kimi_gate.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kimi_gate.load_state_dict(state["kimi_gate"])

    def close(self) -> None:
        if self._own_pool:
            self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
