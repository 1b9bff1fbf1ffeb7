"""Length shaping: the Kimi K1.5 length reward and the DAPO soft overlong penalty.

Kimi K1.5 (Kimi Team 2025, §2.3.3): over the responses of a group or batch with lengths in
[L_min, L_max], λ = 0.5 − (len − L_min)/(L_max − L_min); a correct response gets λ, an incorrect
one min(0, λ) (short wrong answers are not rewarded, long ones are penalised). All lengths
equal → 0. Kimi switches it on only after a warm-up because it slows early learning; here a
`KimiLengthGate` turns it on after a step count or once mean accuracy ≥ 0.3 (either first),
and stays on.

DAPO (Yu et al. 2025, eq. 13) soft overlong punishment with budget L_max and cache L_cache:
0 while len ≤ L_max − L_cache, then linear down to −1 at L_max, −1 beyond.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence


def _check_lengths(lengths, name="lengths"):
    out = []
    for x in lengths:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0 or x != x:
            raise ValueError(f"{name}: expected non-negative numbers, got {x!r}")
        out.append(float(x))
    return out


@dataclass
class KimiLengthGate:
    """On after `min_step` steps (None: never by steps) or once a batch's mean accuracy reaches
    `min_accuracy` (None: never by accuracy); sticky, and saved with `state_dict`."""

    min_step: Optional[int] = None  # steps before the reward switches on regardless of accuracy
    min_accuracy: Optional[float] = 0.3  # mean accuracy of a batch that switches it on
    active: bool = False

    def update(self, step: Optional[int], accuracy: float) -> bool:
        if not self.active:
            by_step = self.min_step is not None and step is not None and step >= self.min_step
            by_acc = self.min_accuracy is not None and accuracy >= self.min_accuracy
            self.active = by_step or by_acc
        return self.active

    def state_dict(self) -> dict:
        return {"active": self.active}

    def load_state_dict(self, state: dict) -> None:
        self.active = bool(state["active"])


def _kimi(lengths: List[float], correct: List[bool]) -> List[float]:
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    out = []
    for n, ok in zip(lengths, correct):
        lam = 0.5 - (n - lo) / (hi - lo)
        out.append(lam if ok else min(0.0, lam))
    return out


def kimi_length_reward(lengths: Sequence[int], correct: Sequence[bool], *, groups: Optional[Sequence] = None,
                       gate: Optional[KimiLengthGate] = None, step: Optional[int] = None) -> List[float]:
    """Kimi K1.5 length reward per response.

    Args:
        lengths: response lengths (tokens).
        correct: whether each response is correct (truthy / falsy; None counts as incorrect).
        groups: optional group id per response; L_min/L_max are then taken per group, otherwise
            over the whole batch.
        gate: optional KimiLengthGate; while it is off every reward is 0.
        step: the training step, for the gate.
    """
    lens = _check_lengths(lengths)
    if len(correct) != len(lens):
        raise ValueError(f"correct: expected one per length ({len(lens)}), got {len(correct)}")
    ok = [bool(c) for c in correct]
    if gate is not None and not gate.update(step, sum(ok) / max(1, len(ok))):
        return [0.0] * len(lens)
    if not lens:
        return []
    if groups is None:
        return _kimi(lens, ok)
    if len(groups) != len(lens):
        raise ValueError(f"groups: expected one id per length ({len(lens)}), got {len(groups)}")
    out = [0.0] * len(lens)
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        for i, v in zip(idx, _kimi([lens[i] for i in idx], [ok[i] for i in idx])):
            out[i] = v
    return out


def overlong_penalty(lengths: Sequence[int], max_length: int, cache_length: int) -> List[float]:
    """DAPO soft overlong punishment: 0, then linear to −1 over the last `cache_length` tokens
    of the `max_length` budget, −1 beyond it."""
    if not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"max_length={max_length!r}: expected a positive int")
    if not isinstance(cache_length, int) or not 0 < cache_length <= max_length:
        raise ValueError(f"cache_length={cache_length!r}: expected an int in (0, max_length={max_length}]")
    free = max_length - cache_length
    out = []
    for n in _check_lengths(lengths):
        if n <= free:
            out.append(0.0)
        elif n <= max_length:
            out.append((free - n) / cache_length)
        else:
            out.append(-1.0)
    return out
