"""A task from JSON-lines files: one problem per line with `prompt` and `answer` (and optionally
`completion`, a reference trace for the SFT cold start, and `id`). Rewards are the library's
verifiers: `fastgrpo.rewards.math.math_reward` (math-verify / sympy equivalence of the last
`<answer>` or `\\boxed{}`) and the strict R1 format reward of `fastgrpo.rewards.format`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional


@dataclass(frozen=True)
class JsonlProblem:
    id: int  # line index (or the row's integer `id`)
    prompt: str  # model input text
    answer: str  # reference answer
    completion: Optional[str] = None  # reference trace for SFT


def read_problems(path: str) -> List[JsonlProblem]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "answer" not in row:
                raise ValueError(f"{path}:{i + 1}: expected an object with a string 'prompt' and an 'answer'")
            out.append(JsonlProblem(id=int(row.get("id", i)), prompt=row["prompt"], answer=str(row["answer"]),
                                    completion=row.get("completion")))
    if len({p.id for p in out}) != len(out):
        raise ValueError(f"{path}: problem ids are not unique")
    return out


class JsonlTask:
    name = "jsonl"

    def __init__(self, path: str, eval_path: Optional[str] = None):
        self.train = read_problems(path)
        if not self.train:
            raise ValueError(f"data.path={path!r}: no problems in the file")
        self.heldout = read_problems(eval_path) if eval_path else []

    def reward_fns(self) -> Dict[str, Callable]:
        from fastgrpo.rewards.format import format_reward
        from fastgrpo.rewards.math import math_reward

        return {"accuracy": lambda c, a: math_reward(c, a),
                "format": lambda c, a: format_reward(c)}
