"""The one input type every reward of the trainer's scoring path
(`fastgrpo.rewards.combine.score_groups`) receives, and the reward-function protocol.

A reward is a callable `fn(inputs: RewardInputs) -> list[float | None]` marked with
`@inputs_reward` (so the scoring path knows to pass the whole `RewardInputs`); a plain
two-argument callable `fn(completions, answers)` (the older task signature) is still accepted.
A user's function is imported from `module:function` (`import_reward`) and wrapped to that
protocol (`user_reward`). The rewards a config names are built in fastgrpo/rewards/registry.py.
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
    step: int = 0  # the training step (for rewards that switch on after a number of steps)

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
                            {k: list(v[start:stop]) for k, v in self.scores.items()}, self.step)


def inputs_reward(fn: Callable) -> Callable:
    """Mark `fn(inputs: RewardInputs) -> scores` as taking the whole RewardInputs."""
    fn.takes_inputs = True
    return fn


def call_reward(fn: Callable, inputs: RewardInputs) -> Sequence[Optional[float]]:
    """Call a reward in either signature."""
    if getattr(fn, "takes_inputs", False):
        return fn(inputs)
    return fn(inputs.completions, inputs.answers)

def import_reward(path: str, field: str = "rewards.functions") -> Callable:
    """The user function at `module:function` (a dotted module, importable or a .py file path);
    a failure raises ValueError naming the config `field`."""
    import importlib
    import importlib.util
    import os

    mod_name, fn_name = path.split(":")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise ImportError(f"no file {mod_name}")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(mod_name))[0], mod_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 — any failure of the user's import is reported with its path
        raise ValueError(f"config {field}: {path!r}: cannot import {mod_name!r} ({type(e).__name__}: {e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"config {field}: {path!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def user_reward(fn: Callable, name: str = "") -> Callable:
    """Adapt a user function to RewardInputs. TRL's reward-function signature is accepted:
    `fn(prompts, completions, completion_ids, **columns)` with every dataset column as a list
    (one entry per completion); fastgrpo also passes `answers` (= the `answer` column) and
    `tests`. Only the keywords the function accepts are passed unless it takes **kwargs; a
    function with two positional parameters not named as above gets (completions, answers)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    params = dict(sig.parameters) if sig is not None else {}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    by_kw = var_kw or any(n in params for n in ("prompts", "completions", "completion_ids", "answers", "answer"))

    @inputs_reward
    def call(inputs: RewardInputs):
        if not by_kw:
            return fn(inputs.completions, inputs.answers)
        kw: Dict[str, Any] = {}
        cols = sorted({k for p in inputs.problems for k in (getattr(p, "row", None) or {})})
        for col in cols:
            kw[col] = [(getattr(p, "row", None) or {}).get(col) for p in inputs.problems]
        kw.update(prompts=inputs.prompts, completions=inputs.completions, completion_ids=inputs.completion_ids,
                  answers=inputs.answers, answer=inputs.answers, tests=inputs.tests)
        if not var_kw:
            kw = {k: v for k, v in kw.items() if k in params}
        return fn(**kw)

    call.__name__ = f"user_reward[{name or getattr(fn, '__name__', 'fn')}]"
    return call
