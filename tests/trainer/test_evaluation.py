"""Held-out evaluation: accuracy, pass@n, and the unbiased pass@k estimator for k <= n."""
import math
from types import SimpleNamespace

import pytest

from fastgrpo.config import EvalConfig, RolloutConfig, load_config
from fastgrpo.trainer.evaluation import evaluate, pass_at_k


def test_pass_at_k_equals_the_combinatorial_definition():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200)
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4.0, 1, 1)):
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(*bad)


class _Engine:
    """Returns, for each prompt, its scripted completions ("right" / "wrong")."""

    def __init__(self, script):
        self.script = script

    def generate(self, prompts, n, sampling):
        return [[SimpleNamespace(text=t, token_ids=[1] * len(t)) for t in self.script[p][:n]] for p in prompts]


def test_evaluate_reports_pass_at_n_and_unbiased_pass_at_k():
    script = {"a": ["right", "wrong", "wrong", "wrong"], "b": ["wrong"] * 4, "c": ["right", "right", "wrong", "right"]}
    problems = [SimpleNamespace(prompt=p, answer="x") for p in script]
    fns = {"accuracy": lambda texts, answers: [1.0 if t == "right" else 0.0 for t in texts]}
    out = evaluate(_Engine(script), problems, fns, EvalConfig(num_samples=4, temperature=1.0, pass_k=[1, 2]),
                   RolloutConfig())
    assert out["eval/accuracy"] == pytest.approx(4 / 12)
    assert out["eval/pass@4"] == pytest.approx(2 / 3)
    assert out["eval/pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert out["eval/pass@2"] == pytest.approx(((1 - 3 / 6) + 0 + 1.0) / 3)   # C(3,2)/C(4,2) = 1/2; c = 3: 1
    with pytest.raises(ValueError, match="pass_k"):
        evaluate(_Engine(script), problems, fns, EvalConfig(num_samples=2, temperature=1.0, pass_k=[3]),
                 RolloutConfig())


def test_config_checks_pass_k_against_num_samples():
    cfg = load_config(None, ["eval.num_samples=8", "eval.temperature=0.7", "eval.pass_k=[1, 4, 8]"])
    assert cfg.eval.pass_k == [1, 4, 8]
    with pytest.raises(ValueError, match=r"eval.pass_k\[1\]"):
        load_config(None, ["eval.num_samples=4", "eval.temperature=0.7", "eval.pass_k=[1, 8]"])
