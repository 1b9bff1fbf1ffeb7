"""What counts as a score, and one rule for rewards that fail.

A score is a real number: an int or a float (numpy's too, a 0-d array or tensor of a number
dtype), finite and within ±1e9, or None (unverifiable: scored `rewards.error_score`, not a
failure). Anything else — a bool (`True` is not a score), a string (`"0.5"` is not a score),
NaN, ±inf, 1e308 — is that reward's failure on that completion, as a call that raises or times
out is its failure on every completion it was asked about. Why ±1e9: advantages are computed in
float32, where 1e308 is inf and the variance of scores near 1e19 overflows; a bound far below
both keeps every failure on one path instead of some stopping the run at the loss and others
passing as numbers (TRL turns a None into NaN and lets NaN through; we do not).

`RewardFaults` keeps, per reward, how many completions failed in the last scoring round (metric
`reward/<name>/failed`), the timed-out calls so far (`reward/<name>/timeouts`), and how many
rounds in a row it failed on every completion: `end_round(limit)` returns the one line that
stops the run once a reward has failed on every completion for `limit` (`max_nan_skips`)
consecutive rounds — a reward that never works is a broken run, not a run that learns nothing
and exits 0.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, List, Optional, Sequence, Tuple

MAX_SCORE = 1e9


class BadScores(ValueError):
    """A reward call whose return value is no list of one score per completion."""


def check_score(v) -> Tuple[Optional[float], Optional[str]]:
    """(the score as a float, None) or (None, why it is not a score); None stays (None, None)."""
    if v is None:
        return None, None
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item") and not isinstance(v, numbers.Number):
        dtype = str(getattr(v, "dtype", ""))
        if "bool" in dtype:
            return None, f"a {type(v).__name__} of dtype {dtype} (a bool is not a score)"
        v = v.item()
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        return None, f"a bool ({v!r}; a bool is not a score: return 1.0 / 0.0)"
    if not isinstance(v, numbers.Real):
        return None, f"a {type(v).__name__} ({v!r:.40}; expected a real number, int or float)"
    f = float(v)
    if not math.isfinite(f):
        return None, f"a non-finite score ({f!r})"
    if abs(f) > MAX_SCORE:
        return None, f"a score out of range ({f:.3g}; expected |score| <= {MAX_SCORE:.0e})"
    return f, None


def check_scores(vals, n: int, name: str) -> Tuple[List[Optional[float]], Dict[int, str]]:
    """Scores of one call: (floats with None where unverifiable or refused, {index: why refused}).
    A value that is no sequence or has the wrong length raises BadScores (the whole call failed)."""
    try:
        if isinstance(vals, (str, bytes, dict, numbers.Number)):
            raise TypeError
        vals = list(vals.tolist() if hasattr(vals, "tolist") and not isinstance(vals, list) else vals)
    except TypeError:
        raise BadScores(f"returned a {type(vals).__name__}, expected a list of {n} scores") from None
    if len(vals) != n:
        raise BadScores(f"returned {len(vals)} scores for {n} completions")
    out: List[Optional[float]] = []
    bad: Dict[int, str] = {}
    for i, v in enumerate(vals):
        f, why = check_score(v)
        out.append(f)
        if why is not None:
            bad[i] = f"returned {why}"
    return out, bad


class RewardFaults:
    """Failure counts of a run's rewards (see the module docstring)."""

    def __init__(self):
        self.failed: Dict[str, int] = {}  # name → completions failed in the last round
        self.total = 0  # completions in the last round
        self.first: Dict[str, str] = {}  # name → the last round's first failure
        self.timeouts: Dict[str, int] = {}  # name → timed-out calls so far
        self.streak: Dict[str, int] = {}  # name → consecutive rounds failed on every completion

    def begin_round(self, names: Sequence[str], total: int) -> None:
        self.failed = {n: 0 for n in names}
        self.first = {}
        self.total = total

    def record(self, name: str, failed: int, first: str = "", timeouts: int = 0) -> None:
        self.failed[name] = self.failed.get(name, 0) + failed
        if first and name not in self.first:
            self.first[name] = first
        if timeouts:
            self.timeouts[name] = self.timeouts.get(name, 0) + timeouts

    def end_round(self, limit: int) -> Optional[str]:
        """Update the streaks; the line that stops the run, or None."""
        for name, n in self.failed.items():
            self.streak[name] = self.streak.get(name, 0) + 1 if self.total and n >= self.total else 0
        for name, k in self.streak.items():
            if limit and k >= limit:
                return (f"reward {name!r} failed on every completion for {k} consecutive steps (max_nan_skips={limit}); "
                        f"last: {self.first.get(name, 'see the reward error lines')}. Fix the function (call it on a "
                        f"few completions by hand) or remove it from rewards.functions")
        return None

    def metrics(self) -> Dict[str, float]:
        out = {f"reward/{n}/failed": float(c) for n, c in self.failed.items()}
        out.update({f"reward/{n}/timeouts": float(c) for n, c in self.timeouts.items()})
        return out

    def state_dict(self) -> dict:
        return {"streak": dict(self.streak), "timeouts": dict(self.timeouts)}

    def load_state_dict(self, state: dict) -> None:
        self.streak = dict(state.get("streak", {}))
        self.timeouts = dict(state.get("timeouts", {}))
