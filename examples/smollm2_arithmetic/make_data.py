"""Arithmetic word problems for SmolLM2-135M-Instruct (examples/smollm2_arithmetic/): one-step
additions and subtractions with operands in [1, 20], phrased a few ways. The model solves about a
fifth to a third of them greedily out of the box (it often computes right and then talks past the
answer), which leaves GRPO room to work with.

    python examples/smollm2_arithmetic/make_data.py OUT_DIR [--train 2000] [--test 200] [--seed 0] [--traces]

writes OUT_DIR/train.jsonl and OUT_DIR/test.jsonl with `question` / `answer` columns (the config
maps `question` to the prompt); problems of the test file never appear in the train file.
`--traces` adds SFT references to the train rows: `completion`, a tool trace for the python tool
(config_python.yaml: the model's call, the tool's answer, its final turn), and `answer_turn`, the
final turn alone (the same cold start without the tool: config_python.yaml's baseline).
"""
from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ["Tom", "Anna", "Li", "Sara", "Omar", "Mia", "Ben", "Zoe"]
THINGS = ["apples", "books", "pens", "coins", "cards", "shells", "stickers", "marbles"]
ADD = ["{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
       "There are {a} {t} in a box. {n} puts in {b} more. How many {t} are in the box?",
       "What is {a} + {b}?"]
SUB = ["{n} had {a} {t} and gave away {b}. How many {t} are left?",
       "There are {a} {t} on a table. {n} takes {b} of them. How many {t} are still on the table?",
       "What is {a} - {b}?"]


def problem(rng: random.Random) -> dict:
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    if rng.random() < 0.5:
        return {"question": rng.choice(ADD).format(n=n, t=t, a=a, b=b), "answer": str(a + b), "expr": f"{a} + {b}"}
    a, b = max(a, b), min(a, b)
    return {"question": rng.choice(SUB).format(n=n, t=t, a=a, b=b), "answer": str(a - b), "expr": f"{a} - {b}"}


def trace(row: dict) -> list:
    """The python tool's trace of a problem: the call (Hermes format, the turn stops at
    </tool_call>), what the tool prints, the final turn."""
    call = json.dumps({"name": "python", "arguments": {"code": f"print({row['expr']})"}})
    return [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": f"{row['answer']}\n"},
            {"role": "assistant", "content": f"The answer is {row['answer']}."}]


def make(out_dir: str, train: int = 2000, test: int = 200, seed: int = 0, traces: bool = False) -> tuple:
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < train + test:
        p = problem(rng)
        if p["question"] not in seen:
            seen.add(p["question"])
            rows.append(p)
    os.makedirs(out_dir, exist_ok=True)
    paths = (os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "test.jsonl"))
    for path, part, is_train in zip(paths, (rows[test:], rows[:test]), (True, False)):
        with open(path, "w") as f:
            for r in part:
                out = {"question": r["question"], "answer": r["answer"]}
                if traces and is_train:
                    out["completion"] = trace(r)
                    out["answer_turn"] = trace(r)[-1]["content"]
                f.write(json.dumps(out) + "\n")
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", action="store_true", help="add SFT tool traces to the train rows")
    a = ap.parse_args()
    print(*make(a.out_dir, a.train, a.test, a.seed, a.traces))
