"""Every config in examples/ loads and validates; the CPU example's data generator writes disjoint
train / test files that the task loader reads through SmolLM2's chat template."""
import glob
import json
import os
import subprocess
import sys

import pytest

from fastgrpo.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True))


def test_there_are_examples():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.relpath(p, ROOT) for p in CONFIGS])
def test_example_config_validates(path):
    cfg = load_config(path)
    assert cfg.model.path != "tiny" and cfg.data.path


def test_cpu_example_data_and_task(tmp_path):
    out = tmp_path / "data"
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "smollm2_arithmetic", "make_data.py"), str(out),
                    "--train", "50", "--test", "10"], check=True, capture_output=True)
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (out / "test.jsonl").read_text().splitlines()]
    assert len(train) == 50 and len(test) == 10
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    from fastgrpo.trainer.build import build_task, build_tokenizer

    cfg = load_config(os.path.join(ROOT, "examples", "smollm2_arithmetic", "config.yaml"),
                      [f"data.path={out / 'train.jsonl'}", f"data.eval_path={out / 'test.jsonl'}"])
    tok, ctx = build_tokenizer(cfg.model)
    task = build_task(cfg.data, tok, context_len=ctx, max_new_tokens=cfg.rollout.max_new_tokens)
    assert len(task.train) == 50 and len(task.heldout) == 10
    assert task.train[0].prompt.startswith("<|im_start|>system") and task.train[0].prompt.endswith("<|im_start|>assistant\n")


def test_python_tool_example_traces(tmp_path):
    """`make_data.py --traces` writes tool traces whose tool answer is what the built-in python tool
    prints for the call, and config_python.yaml turns them into SFT segments through SmolLM2's
    template: the call and the final turn trained, the tool's answer not; held-out rows carry none;
    the baseline's column (answer_turn) is the final turn alone."""
    out = tmp_path / "data"
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "smollm2_arithmetic", "make_data.py"), str(out),
                    "--train", "6", "--test", "3", "--traces"], check=True, capture_output=True)
    train = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    test = [json.loads(x) for x in (out / "test.jsonl").read_text().splitlines()]
    assert all("completion" not in r for r in test)
    from fastgrpo.episodes.builtin import python
    from fastgrpo.episodes.calls import parse_tool_calls

    for r in train[:2]:
        call, answer, final = r["completion"]
        (parsed,), errors = parse_tool_calls(call["content"])
        assert not errors
        assert python(**parsed.arguments) == answer["content"] == r["answer"] + "\n"
        assert final["content"] == r["answer_turn"] == f"The answer is {r['answer']}."
    from fastgrpo.pipeline import load_run

    cfg = load_config(os.path.join(ROOT, "examples", "smollm2_arithmetic", "config_python.yaml"),
                      [f"data.path={out / 'train.jsonl'}", f"data.eval_path={out / 'test.jsonl'}"])
    parts = load_run(cfg, log=lambda m: None, need_sft=True)
    p = parts.task.train[0]
    assert '"name": "python"' in p.prompt and p.prompt.endswith("<|im_start|>assistant\n")
    from fastgrpo.trainer.sft import sft_examples

    ((_, segments),) = sft_examples(parts.task, [p], None, 0.0, parts.tokenizer)
    trained = [s for s, on in segments if on]
    assert trained[0] == train[0]["completion"][0]["content"] and trained[-1] == train[0]["answer_turn"]
    untrained = parts.tokenizer.decode([i for s, on in segments if not on for i in s])
    assert train[0]["answer"] + "\n" in untrained and "<|im_start|>tool" in untrained
