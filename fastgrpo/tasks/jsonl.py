"""The older jsonl task (`data.task=jsonl`): a math task over a JSON-lines file of `prompt` /
`answer` rows (optionally `completion` and `id`), built by `fastgrpo.tasks.build.build_task` like
any other source; its class (`JsonlTask`, with the strict R1 `format` reward older configs list)
lives in `fastgrpo.tasks.math`.
"""
from __future__ import annotations

from typing import Optional

from fastgrpo.config import DataConfig
from fastgrpo.tasks.base import Problem
from fastgrpo.tasks.build import build_task
from fastgrpo.tasks.math import JsonlTask

JsonlProblem = Problem  # the older name of the problem record

__all__ = ["JsonlTask", "JsonlProblem", "load_jsonl_task"]


def load_jsonl_task(path: str, eval_path: Optional[str] = None) -> JsonlTask:
    """The jsonl task of `path` (and the held-out `eval_path`)."""
    return build_task(DataConfig(task="jsonl", path=path, eval_path=eval_path))
