"""The older jsonl task (`data.task=jsonl`): a math task over a JSON-lines file of `prompt` /
`answer` rows (optionally `completion` and `id`), now built by `fastgrpo.tasks.build.build_task`
like any other source. Kept for its name and its rewards: `accuracy` (Math-Verify, answer_format
auto) and the strict R1 `format` reward of `fastgrpo.rewards.format`, which older configs list.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from fastgrpo.config import DataConfig
from fastgrpo.tasks.base import Problem
from fastgrpo.tasks.math import MathTask

JsonlProblem = Problem  # the older name of the problem record


class JsonlTask(MathTask):
    name = "jsonl"

    def __init__(self, path: str, eval_path: Optional[str] = None):
        from fastgrpo.tasks.build import build_task

        built = build_task(DataConfig(task="jsonl", path=path, eval_path=eval_path))
        super().__init__(built.train, built.heldout, built.answer_format, built.answer_tag, few_shot=built.few_shot,
                         source=path)

    @classmethod
    def of(cls, *args, **kw) -> "JsonlTask":
        """A JsonlTask over problems built elsewhere (MathTask's arguments)."""
        task = cls.__new__(cls)
        MathTask.__init__(task, *args, **kw)
        return task

    def reward_fns(self, pool=None) -> Dict[str, Callable]:
        from fastgrpo.rewards.format import format_reward

        return {**super().reward_fns(pool), "format": lambda c, a: format_reward(c)}
