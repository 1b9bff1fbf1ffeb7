"""The task protocol: what a trainer needs from any task, and the one problem record.

A task is data + prompt formatting + the rewards it defines (DESIGN.md, "Layout"). It provides
`name`, `train` / `heldout` (lists of `Problem`), `reward_fns(pool=None)` → {"accuracy": fn, …},
`has_completions` (SFT is allowed only when every train problem has a reference completion) and
`format_tags` (the tags its answers are expected in, a hint for a format reward; None = no
tags). `fastgrpo.tasks.build.build_task(DataConfig, …)` builds one from a run config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Problem:
    id: int  # stable, unique across train + heldout: the curriculum's key and the id in reward errors
    prompt: str  # the exact model input text (chat template, system prompt, few-shot already applied)
    answer: str = ""  # reference answer (math: the extracted final answer, checked at load)
    tests: Optional[str] = None  # code: the hidden unit tests (asserts or a test program)
    completion: Optional[Any] = None  # SFT reference: text ending as the template's assistant turn would,
    # or a tool trace: [{role, content}, …], the model's turns with tool / user messages between them
    key: str = ""  # the user's name for the row in messages: their id column, else `file:line` / `file row N`
    row: Dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)  # every raw column (TRL passes these to reward fns)


class Task:
    """The attributes every data task has; subclasses define `reward_fns`."""

    name: str = "task"
    format_tags: Optional[Tuple[str, ...]] = None  # tags a completion's answer is expected in (None = none)

    def __init__(self, train: List[Problem], heldout: List[Problem], few_shot: Optional[List[Problem]] = None,
                 source: str = ""):
        self.train: List[Problem] = train  # problems trained on
        self.heldout: List[Problem] = heldout  # problems for eval/accuracy, never trained on
        self.few_shot: List[Problem] = few_shot or []  # rows shown as example turns (in neither split)
        self.source = source  # where the train rows came from (data.path)

    @property
    def has_completions(self) -> bool:
        """True when every train problem has a reference completion (SFT needs one per row)."""
        return bool(self.train) and all(p.completion for p in self.train)

    def reward_fns(self, pool=None) -> Dict[str, Callable]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, source={self.source!r}, train={len(self.train)}, "
                f"heldout={len(self.heldout)}, few_shot={len(self.few_shot)})")
