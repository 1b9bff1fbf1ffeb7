"""Rewards by name: what `rewards.functions` in a run config can list, and the one input type
every reward of the trainer's scoring path (`fastgrpo.rewards.combine.score_groups`) receives.

A reward in the registry is a callable `fn(inputs: RewardInputs) -> list[float | None]` marked
with `@inputs_reward` (so the scoring path knows to pass the whole `RewardInputs`); a plain
two-argument callable `fn(completions, answers)` (the older task signature) is still accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence


@dataclass
class RewardInputs:
    """One scoring call's inputs, completion-major (B prompts × G completions, group after group)."""

    completions: List[str]  # decoded completion texts
    problems: List[Any]  # the task's Problem of each completion (repeated G times)
    lengths: List[int] = field(default_factory=list)  # completion token counts
    truncated: List[bool] = field(default_factory=list)  # True where generation hit the length cap
    completion_ids: List[List[int]] = field(default_factory=list)  # completion token ids
    group_size: int = 1  # G (completions i·G … i·G+G−1 answer the same prompt)
    scores: Dict[str, List[Optional[float]]] = field(default_factory=dict)  # rewards scored earlier in this call

    @property
    def answers(self) -> List[str]:
        return [getattr(p, "answer", "") for p in self.problems]

    @property
    def prompts(self) -> List[str]:
        return [getattr(p, "prompt", "") for p in self.problems]

    @property
    def tests(self) -> List[Optional[str]]:
        return [getattr(p, "tests", None) for p in self.problems]

    def __len__(self) -> int:
        return len(self.completions)

    def slice(self, start: int, stop: int) -> "RewardInputs":
        """The completions [start, stop) (whole groups when start, stop are multiples of G)."""
        cut = lambda xs: list(xs[start:stop]) if xs else []  # noqa: E731
        return RewardInputs(cut(self.completions), cut(self.problems), cut(self.lengths), cut(self.truncated),
                            cut(self.completion_ids), self.group_size,
                            {k: list(v[start:stop]) for k, v in self.scores.items()})


def inputs_reward(fn: Callable) -> Callable:
    """Mark `fn(inputs: RewardInputs) -> scores` as taking the whole RewardInputs."""
    fn.takes_inputs = True
    return fn


def call_reward(fn: Callable, inputs: RewardInputs) -> Sequence[Optional[float]]:
    """Call a reward in either signature."""
    if getattr(fn, "takes_inputs", False):
        return fn(inputs)
    return fn(inputs.completions, inputs.answers)
