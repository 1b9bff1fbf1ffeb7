"""The built-in task of the embedded demos: integer addition (the default demo) or multiplication
(the tool demo, fastgrpo/demo/tools.py) with a held-out split.

Prompts are `"12+7="`; the expected completion is `<think>7+12</think><answer>19</answer>` (the
reasoning restates the sum commuted — short on purpose so that completions stay ≤ 24 tokens with
the character tokenizer, where the tags are single tokens). Operands are drawn from
[min_operand, max_operand); a fixed random subset of the pairs is held out for `eval/accuracy`, so the
accuracy measured after RL is on sums the model never trained on.

Products (`operation="*"`, "412*356="): three-digit operands are beyond what the tiny model
computes in its head. With the calculator tool (`tools` holds "calculator",
rollout.tools=[calculator]) the reference trace is an episode: a call, the tool's answer, then
the same final turn, `<tool_call>{"name":"calculator","arguments":{"expression":"412*356"}}
</tool_call>` · `\n<tool_response>\n146672\n</tool_response>\n` · `<think>356*412</think><answer>
146672</answer>`, given to SFT as segments (text, trained): the tool's answer is what the episode
runner renders between two turns (fastgrpo.episodes.render, tag format), and SFT does not
train on it, as GRPO does not train on environment tokens. Above `MAX_PAIRS` pairs (the tool
demo has 466,489) the problems are a seeded sample of the pairs instead of all of them.

Rewards are the library's, exact and cheap (no sympy): accuracy is 1 when the last
`<answer>…</answer>` (`fastgrpo.rewards.math.extract_answer`, no last-number fallback) holds the
right integer; format is `fastgrpo.rewards.format_reward` (exactly one non-empty think block
followed by one answer block). With tools they score the final turn. A task object is what the
trainer needs from any task: `train` / `heldout` lists of `Problem`, `reward_fns()`, and
`sft_completion()` for the cold start.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from fastgrpo.rewards.format import format_reward as _format_reward
from fastgrpo.rewards.math import extract_answer

_INT = re.compile(r"-?\d+")
_OPS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}
# problems kept at most (train + held out): GRPO's 200 steps x 32 prompts see 6,400 of them, and a
# million Problem objects would cost ~0.5 GB and seconds at every start
MAX_PAIRS = 100_000
# the tag format of fastgrpo.episodes for tokenizers without a chat template (calls.py's Hermes
# call, render.py's tool answer), written out here because tasks sit above episodes in the layout;
# tests/demo/test_tools_demo.py checks them against the episode runner's rendering
TOOL_CALL = "<tool_call>{}</tool_call>"
TOOL_RESPONSE = "\n<tool_response>\n{}\n</tool_response>\n"


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
    """`a <operation> b` with a, b in [min_operand, max_operand); `num_heldout` pairs held out.
    `tools`: the names of the run's tools; with "calculator" and operation "*" the reference
    traces call it."""

    name = "arithmetic"
    has_completions = True  # sft_completion gives every problem its reference trace
    format_tags = ("think", "answer")  # the tags of the expected completion

    def __init__(self, max_operand: int = 50, num_heldout: int = 200, seed: int = 0, operation: str = "+",
                 min_operand: int = 0, tools: Sequence[str] = ()):
        if operation not in _OPS:
            raise ValueError(f"operation={operation!r}: expected one of {sorted(_OPS)}")
        if not isinstance(max_operand, int) or max_operand < 2:
            raise ValueError(f"max_operand={max_operand!r}: expected an integer >= 2")
        if not isinstance(min_operand, int) or not 0 <= min_operand <= max_operand - 2:
            raise ValueError(f"min_operand={min_operand!r}: expected an integer in [0, max_operand - 2]")
        span = max_operand - min_operand
        total = span * span
        if not isinstance(num_heldout, int) or not 0 <= num_heldout < min(total, MAX_PAIRS):
            raise ValueError(f"num_heldout={num_heldout!r}: expected an integer in [0, {min(total, MAX_PAIRS)}) "
                             f"(there are {total} distinct problems with max_operand={max_operand})")
        self.operation = operation
        self.tool = "calculator" if operation == "*" and "calculator" in tools else None
        if total <= MAX_PAIRS:  # every pair, shuffled (the default demo's split, unchanged)
            pairs = [(a, b) for a in range(min_operand, max_operand) for b in range(min_operand, max_operand)]
            random.Random(seed).shuffle(pairs)
        else:  # a seeded sample of distinct pairs, never the whole list
            pairs = [(min_operand + i // span, min_operand + i % span) for i in random.Random(seed).sample(range(total),
                                                                                                         MAX_PAIRS)]
        fn = _OPS[operation]
        problems = [Problem(id=a * max_operand + b, prompt=f"{a}{operation}{b}=", answer=str(fn(a, b))) for a, b in pairs]
        self.heldout: List[Problem] = problems[:num_heldout]
        self.train: List[Problem] = problems[num_heldout:]

    @classmethod
    def from_config(cls, dcfg, tools=None) -> "ArithmeticTask":
        """The task of a run's `data` section; `tools`: EpisodeParts.prompt_tools (schemas first)."""
        names = [s.get("function", s).get("name") for s in tools[0]] if tools else []
        return cls(dcfg.max_operand, dcfg.num_heldout, dcfg.seed, operation=dcfg.operation,
                   min_operand=dcfg.min_operand, tools=names)

    @staticmethod
    def operands(problem: Problem):
        a, b = re.split(r"[+*]", problem.prompt.rstrip("="))
        return int(a), int(b)

    def sft_completion(self, problem: Problem, rng: random.Random,
                       noise: float = 0.0) -> Union[str, List[Tuple[str, bool]]]:
        """The reference trace. Sums: with probability `noise`, a problem whose units digits
        carry gets the classic slip of a weak teacher: the carry is dropped (27+15 → 32). The cold
        start then learns the format and the easy sums but is torn on carries, the headroom RL
        with a verifiable reward removes. Products with the calculator: segments (text, trained)
        of a call, the tool's answer (not trained) and the final turn; with probability `noise`
        the teacher rounds the answer it reads back down to thousands (146672 → 146000), the
        slip RL then removes. Products without the tool: the final turn alone, exact (`noise`
        changes nothing: there is no tool answer to misread)."""
        a, b = self.operands(problem)
        if self.operation == "+":
            ans = a + b
            if noise > 0 and (a % 10) + (b % 10) >= 10 and rng.random() < noise:
                ans -= 10
            return f"<think>{b}+{a}</think><answer>{ans}</answer>"
        final = f"<think>{b}*{a}</think><answer>{a * b}</answer>"
        if self.tool is None:
            return final
        if noise > 0 and rng.random() < noise:
            final = f"<think>{b}*{a}</think><answer>{a * b // 1000 * 1000}</answer>"
        # compact JSON: 4 tokens fewer for the char tokenizer than json.dumps' spaced default
        call = json.dumps({"name": self.tool, "arguments": {"expression": f"{a}*{b}"}}, separators=(",", ":"))
        return [(TOOL_CALL.format(call), True), (TOOL_RESPONSE.format(a * b), False), (final, True)]

    def reward_fns(self) -> Dict[str, Callable]:
        return {"accuracy": accuracy_reward, "format": format_reward}
