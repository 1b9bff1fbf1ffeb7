"""Code task: problems with hidden unit tests; accuracy = every test passes when the completion's
program runs in the sandbox (`fastgrpo.rewards.code.code_reward`, binary as in DeepSeek-R1 /
DeepCoder).

The `tests` column holds Python: top-level asserts (MBPP's `test_list`, a list of assert strings,
is joined one a line) or a test program (HumanEval's `def check(candidate): …` followed by its
call). Tests that do not compile are a load-time error naming the row, not a data error found
mid-run.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from fastgrpo.rewards.code import code_reward
from fastgrpo.rewards.registry import RewardInputs, inputs_reward
from fastgrpo.tasks.base import Problem, Task


def tests_text(value, where: str, column: str = "tests") -> str:
    """A tests cell as Python source, checked to compile."""
    if isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value):
        value = "\n".join(value)
    if not isinstance(value, str) or not value.strip():
        got = "empty" if isinstance(value, (str, list, tuple)) else f"{type(value).__name__}"
        raise ValueError(f"{where}: column {column!r} is {got}; expected Python unit tests (asserts or a test program)")
    try:
        compile(value, "tests.py", "exec")
    except (SyntaxError, ValueError) as e:
        line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise ValueError(f"{where}: column {column!r}: the tests do not compile ({type(e).__name__}{line}: "
                         f"{getattr(e, 'msg', e)})") from None
    return value


class CodeTask(Task):
    """Problems with hidden unit tests; accuracy = all tests pass in the sandbox."""

    name = "code"

    def __init__(self, train: List[Problem], heldout: List[Problem], timeout: float = 5.0, **kw):
        super().__init__(train, heldout, **kw)
        self.timeout = timeout  # wall-clock seconds per program run

    def reward_fns(self, pool=None) -> Dict[str, Callable]:
        timeout = self.timeout

        @inputs_reward
        def accuracy(inputs: RewardInputs) -> List[Optional[float]]:
            """1.0 when the completion's program passes every hidden test, else 0.0 (None: broken tests)."""
            return code_reward(inputs.completions, inputs.tests, timeout, pool=pool,
                               example_ids=[getattr(p, "id", i) for i, p in enumerate(inputs.problems)])

        return {"accuracy": accuracy}
