"""Runs whose rewards are the user's own or broken (issue 26): held-out accuracy is the task's
verifier whatever the training rewards are (a run with only `my.py:score` and the docs'
process-rewards YAML are evaluated), a task with no verifier evaluates what it can and says so
once, a reward that fails on every completion stops the run with one line naming it, and a hung
reward costs its timeout, not the run."""
import json
import os
import pathlib
import re
import textwrap
from types import SimpleNamespace

import pytest
from trainer_helpers import TINY, NoisyTask

from fastgrpo import cli
from fastgrpo.config import EvalConfig, RewardsConfig, RolloutConfig, load_config
from fastgrpo.pipeline import run_train
from fastgrpo.rewards.registry import build_rewards
from fastgrpo.tasks.base import Problem
from fastgrpo.trainer.evaluation import evaluate
from fastgrpo.trainer.grpo import Trainer

# the process-rewards example (once in README.md, now on the rewards page of the docs)
PROCESS_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guides" / "rewards.md"
# the tiny run's settings without its rewards (each test names its own)
BASE = [s for s in TINY if not s.startswith("rewards.")] + ["steps=1", "eval.every=0"]


def _reward_file(tmp_path, src, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(src))
    return str(path)


def _rows(out):
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]


def test_a_run_with_only_user_rewards_is_evaluated_by_the_task_verifier(tmp_path):
    path = _reward_file(tmp_path, """
        def score(completions, **kw):
            return [float(len(c) % 2) for c in completions]
    """)
    out = str(tmp_path / "run")
    cfg = load_config(None, BASE + [f"logging.out_dir={out}", f"rewards.functions=[{path}:score]", "rewards.weights=[1.0]"])
    summary = run_train(cfg, log=lambda *a, **k: None)
    assert summary["steps"] == 1 and summary["accuracy_after"] is not None
    evals = [r for r in _rows(out) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]  # before and after, scored by the arithmetic task's answers


def test_readme_process_rewards_yaml_runs(tmp_path):
    block = PROCESS_DOC.read_text().split("## Process rewards", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    assert "functions: [format]" in block  # the docs' own example: no accuracy among the training rewards
    (tmp_path / "process.yaml").write_text(block)
    out = str(tmp_path / "run")
    cfg = load_config(str(tmp_path / "process.yaml"), BASE + [f"logging.out_dir={out}"])
    assert cfg.rewards.functions == ["format"] and cfg.rewards.process.scorer == "arithmetic"
    summary = run_train(cfg, log=lambda *a, **k: None)
    assert summary["steps"] == 1 and "accuracy_after" in summary


class _NoVerifier:
    name = "open"

    def reward_fns(self):
        return {}


class _Engine:
    def generate(self, prompts, n, sampling=None):
        return [[SimpleNamespace(text=f"<think>a</think><answer>{j}</answer>", token_ids=[1] * (j + 1),
                                 finish_reason="length" if j else "stop") for j in range(n)] for _ in prompts]


def test_a_task_without_verifier_evaluates_what_it_can_and_says_so_once():
    rewards = build_rewards(RewardsConfig(functions=["format"], weights=[1.0]), _NoVerifier(), 16)
    problems = [Problem(id=i, prompt=f"p{i}") for i in range(3)]
    said = []
    ecfg = EvalConfig(num_samples=2, temperature=0.0)
    for _ in range(2):
        out = evaluate(_Engine(), problems, rewards, ecfg, RolloutConfig(), log=said.append)
        assert "eval/accuracy" not in out and out["eval/reward/format"] == 1.0
        assert out["eval/truncated"] == 0.5 and out["eval/length_mean"] == 1.5
    assert len(said) == 1 and "no verifier" in said[0] and "eval/reward/<name>" in said[0]


def test_a_run_whose_task_has_no_verifier_trains_and_logs_no_accuracy(tmp_path, monkeypatch):
    """The pipeline around `evaluate`: before, during and after RL it logs what it has, never a
    KeyError on the missing eval/accuracy."""
    from fastgrpo.trainer import evaluation

    monkeypatch.setattr(evaluation, "_verifier", lambda reward_fns: None)  # a task without answers to check
    out = str(tmp_path / "run")
    said = []
    cfg = load_config(None, BASE + [f"logging.out_dir={out}", "rewards.functions=[format]", "rewards.weights=[1.0]"])
    summary = run_train(cfg, log=lambda *a, **k: said.append(" ".join(map(str, a))))
    assert summary["steps"] == 1 and summary["accuracy_after"] is None and summary["accuracy_before"] is None
    assert any("held-out accuracy: n/a (no verifier" in m for m in said), said
    assert [r["step"] for r in _rows(out) if "eval/reward/format" in r] == [0, 1]


def test_the_held_out_accuracy_is_the_tasks_when_the_run_trains_on_other_rewards():
    rewards = build_rewards(RewardsConfig(functions=["format"], weights=[1.0]), NoisyTask(), 16)
    assert "accuracy" not in rewards and rewards.verifier is not None
    problems = [Problem(id=i, prompt=f"p{i}", answer="1") for i in range(2)]  # NoisyTask: a digit 1..4 is right
    out = evaluate(_Engine(), problems, rewards, EvalConfig(num_samples=2, temperature=0.0), RolloutConfig())
    assert out["eval/accuracy"] == 0.5 and out["eval/pass@2"] == 1.0  # "<answer>0" wrong, "<answer>1" right


@pytest.mark.parametrize("value", ["float('nan')", "1e308", "'0.5'", "True"])
def test_a_reward_that_fails_everywhere_stops_the_run_with_one_line(tmp_path, capsys, value):
    path = _reward_file(tmp_path, f"""
        def broken(completions, **kw):
            return [{value}] * len(completions)
    """, name="broken.py")
    argv = ["train", "--out", str(tmp_path / "run")] + [x for s in BASE if not s.startswith(("steps=", "sft."))
                                                        for x in ("--set", s)]
    argv += ["--set", "steps=6", "--set", "max_nan_skips=2", "--set", f"rewards.functions=[accuracy, {path}:broken]",
             "--set", "rewards.weights=[1.0, 1.0]"]
    rc = cli.main(argv)
    cap = capsys.readouterr()
    stops = [x for x in cap.err.splitlines() if x.startswith("fastgrpo:")]
    assert rc == 3 and len(stops) == 1, cap.err
    assert re.search(r"stopped at step 2: reward '.*broken.py:broken' failed on every completion for 2 consecutive "
                     r"steps \(max_nan_skips=2\)", stops[0]), stops[0]
    errors = [x for x in cap.out.splitlines() if "reward error" in x]
    assert len(errors) == 2 and all("16 of 16 completions failed" in x for x in errors)  # one line a step, not 16
    assert "Traceback" not in cap.err


def test_a_hung_reward_costs_its_timeout_and_the_run_goes_on(cfg_factory, tmp_path):
    path = _reward_file(tmp_path, """
        import time

        def hang(completions, **kw):
            time.sleep(3600)
    """, name="hang.py")
    msgs = []
    t = Trainer(cfg_factory("steps=1", "rewards.timeout=1", f"rewards.functions=[accuracy, {path}:hang]",
                            "rewards.weights=[1.0, 1.0]"), task=NoisyTask(), log=msgs.append)
    try:
        logs = t.step()
    finally:
        t.close()
    assert logs[f"reward/{path}:hang/timeouts"] == 1.0 and logs[f"reward/{path}:hang/failed"] == 16.0
    assert any("timed out after 1 s (rewards.timeout)" in m for m in msgs)
