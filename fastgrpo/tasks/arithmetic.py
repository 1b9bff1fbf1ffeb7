"""The built-in task of the embedded demo: integer addition with a held-out split.

Prompts are `"12+7="`; the expected completion is `<think>7+12</think><answer>19</answer>` (the
reasoning restates the sum commuted — short on purpose so that completions stay ≤ 24 tokens with
the character tokenizer, where the tags are single tokens). Operands are drawn from
[0, max_operand); a fixed random subset of the pairs is held out for `eval/accuracy`, so the
accuracy measured after RL is on sums the model never trained on.

Rewards are the library's, exact and cheap (no sympy): accuracy is 1 when the last
`<answer>…</answer>` (`fastgrpo.rewards.math.extract_answer`, no last-number fallback) holds the
right integer; format is `fastgrpo.rewards.format_reward` (exactly one non-empty think block
followed by one answer block). A task object is what the trainer needs from any task: `train` / `heldout` lists
of `Problem`, `reward_fns()`, and `sft_completion()` for the cold start.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from fastgrpo.rewards.format import format_reward as _format_reward
from fastgrpo.rewards.math import extract_answer

_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    id: int  # stable id (reported with reward errors, tracked by the curriculum)
    prompt: str  # model input text
    answer: str  # reference answer text


def accuracy_reward(completions: List[str], answers: List[str]) -> List[float]:
    """1.0 when the last <answer> block holds the reference integer, else 0.0."""
    out = []
    for c, a in zip(completions, answers):
        got = extract_answer(c, last_number_fallback=False)
        out.append(1.0 if got is not None and _INT.fullmatch(got) and int(got) == int(a) else 0.0)
    return out


def format_reward(completions: List[str], answers: Optional[List[str]] = None) -> List[float]:
    """`fastgrpo.rewards.format_reward` in the trainer's reward signature (answers unused)."""
    return _format_reward(completions)


class ArithmeticTask:
    """Addition problems a+b with a, b in [0, max_operand); `num_heldout` pairs held out."""

    name = "arithmetic"
    has_completions = True  # sft_completion gives every problem its reference trace
    format_tags = ("think", "answer")  # the tags of the expected completion

    def __init__(self, max_operand: int = 50, num_heldout: int = 200, seed: int = 0):
        if not isinstance(max_operand, int) or max_operand < 2:
            raise ValueError(f"max_operand={max_operand!r}: expected an integer >= 2")
        total = max_operand * max_operand
        if not isinstance(num_heldout, int) or not 0 <= num_heldout < total:
            raise ValueError(f"num_heldout={num_heldout!r}: expected an integer in [0, {total}) "
                             f"(there are {total} distinct problems with max_operand={max_operand})")
        pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
        random.Random(seed).shuffle(pairs)
        problems = [Problem(id=a * max_operand + b, prompt=f"{a}+{b}=", answer=str(a + b)) for a, b in pairs]
        self.heldout: List[Problem] = problems[:num_heldout]
        self.train: List[Problem] = problems[num_heldout:]

    @staticmethod
    def operands(problem: Problem):
        a, b = problem.prompt.rstrip("=").split("+")
        return int(a), int(b)

    def sft_completion(self, problem: Problem, rng: random.Random, noise: float = 0.0) -> str:
        """The reference trace. With probability `noise`, a problem whose units digits carry
        gets the classic slip of a weak teacher: the carry is dropped (27+15 → 32). The cold
        start then learns the format and the easy sums but is torn on carries, the headroom RL
        with a verifiable reward removes."""
        a, b = self.operands(problem)
        ans = a + b
        if noise > 0 and (a % 10) + (b % 10) >= 10 and rng.random() < noise:
            ans -= 10
        return f"<think>{b}+{a}</think><answer>{ans}</answer>"

    def reward_fns(self) -> Dict[str, Callable]:
        return {"accuracy": accuracy_reward, "format": format_reward}
