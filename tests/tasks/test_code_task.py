"""A code task end to end: MBPP-style rows (a test_list column mapped to tests), accuracy through
the sandboxed code_reward on RewardInputs, a right and a wrong solution."""
import json

from fastgrpo.config import DataConfig
from fastgrpo.rewards.registry import RewardInputs, call_reward
from fastgrpo.tasks.build import build_task

ROWS = [{"text": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"], "task_id": 11},
        {"text": "Write neg(x).", "test_list": ["assert neg(2) == -2"], "task_id": 12}]


def test_code_task_scores_right_and_wrong(tmp_path, pool):
    p = tmp_path / "mbpp.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    task = build_task(DataConfig(path=str(p), columns={"prompt": "text", "tests": "test_list", "id": "task_id"}))
    assert task.name == "code" and [q.id for q in task.train] == [11, 12]
    assert task.train[0].tests == "assert add(1, 2) == 3\nassert add(-1, 1) == 0"
    assert task.train[0].row["task_id"] == 11 and not task.has_completions
    acc = task.reward_fns(pool)["accuracy"]
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a * b\n```"
    neg = "def neg(x):\n    return -x"
    q0, q1 = task.train
    inputs = RewardInputs(completions=[right, wrong, neg, "no code here ("], problems=[q0, q0, q1, q1], group_size=2)
    assert call_reward(acc, inputs) == [1.0, 0.0, 1.0, 0.0]
