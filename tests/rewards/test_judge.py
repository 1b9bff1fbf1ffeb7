"""Reward models and judges (fastgrpo/rewards/judge.py) with tiny models built from configs: a
reward model trained here to prefer a marker, an untrained judge whose score is checked against
a hand computation from its logits, the math accuracy that asks the judge only on unparsable
answers, and every bad input (unloadable folder, labels outside the vocabulary, no parsable
score, scores of the wrong length) as a load-time error naming the reward or a reported score."""
import logging
import math
import random
from types import SimpleNamespace

import pytest
import torch

from fastgrpo.config import RewardModelConfig, RewardsConfig, load_config
from fastgrpo.rewards.combine import score_groups
from fastgrpo.rewards.judge import JudgedAccuracy, JudgeReward, RewardModelReward, group_normalize
from fastgrpo.rewards.registry import RewardInputs, build_rewards
from fastgrpo.tasks.base import Problem
from reward_models import MARKER, marker_pairs, tiny_judge, marker_rm


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return marker_rm(tmp_path_factory)


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    return tiny_judge(str(tmp_path_factory.mktemp("judge") / "judge"))


def _inputs(prompts, completions, answers=None, G=1):
    answers = answers or [""] * len(prompts)
    probs = [Problem(id=i, prompt=p, answer=a) for i, (p, a) in enumerate(zip(prompts, answers))]
    return RewardInputs(completions=list(completions), problems=probs, group_size=G)


def _judge_cfg(path, **kw):
    base = dict(kind="judge", path=path, device="cpu", rubric="Q:{prompt} A:{completion} R:{answer} score:",
                labels=["1", "2", "3"], batch_size=2)
    base.update(kw)
    return RewardModelConfig(**base)


def test_group_normalize_z_scores_and_zero_sigma_groups():
    out = group_normalize([1.0, 3.0, 2.0, 2.0, None, 5.0], 2)
    assert out[:2] == [-1.0, 1.0]  # μ = 2, σ = 1
    assert out[2:4] == [0.0, 0.0]  # σ = 0: no preference
    assert out[4] is None and out[5] == 0.0  # None kept out; one score left: 0
    g = group_normalize([0.5, 1.5, 4.0], 3)
    mu = (0.5 + 1.5 + 4.0) / 3
    sd = math.sqrt(sum((v - mu) ** 2 for v in (0.5, 1.5, 4.0)) / 3)
    assert g == pytest.approx([(v - mu) / sd for v in (0.5, 1.5, 4.0)])


def test_trained_reward_model_prefers_the_marker_batched_like_one_at_a_time(rm_path):
    rm = RewardModelReward("marker", RewardModelConfig(path=rm_path, device="cpu", batch_size=3))
    cho, rej = marker_pairs(random.Random(99), 40)  # pairs the model never saw
    sc, sr = rm.raw_scores(cho), rm.raw_scores(rej)
    assert sum(a > b for a, b in zip(sc, sr)) >= 36, (sc[:5], sr[:5])
    one = RewardModelReward("marker1", RewardModelConfig(path=rm_path, device="cpu", batch_size=1))
    assert rm.raw_scores(cho[:7]) == pytest.approx(one.raw_scores(cho[:7]), abs=1e-5)  # padding changes nothing
    inputs = _inputs(["a:"] * 4, ["x!", "xy", "y", "!!"], G=2)
    raw = rm.raw_scores(rm.texts(inputs))
    assert rm.texts(inputs)[0] == "a:x!"  # no chat template: prompt + completion
    grouped = RewardModelReward("g", RewardModelConfig(path=rm_path, device="cpu", normalize="group"))
    assert grouped(inputs) == pytest.approx(group_normalize(raw, 2))
    assert grouped.metrics()["reward/g/raw_mean"] == pytest.approx(sum(raw) / 4)  # before normalisation


def test_reward_model_uses_its_own_chat_template_with_the_rows_raw_prompt(rm_path, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_path)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    import shutil

    folder = str(tmp_path / "rm_chat")
    shutil.copytree(rm_path, folder)
    tok.save_pretrained(folder)
    rm = RewardModelReward("chat", RewardModelConfig(path=folder, device="cpu"))
    p = Problem(id=0, prompt="SYSTEM ... formatted 1+2=", answer="3", row={"prompt": "1+2="})
    chat = Problem(id=1, prompt="formatted", row={"messages": [{"role": "user", "content": "q"},
                                                              {"role": "assistant", "content": "reference"}]})
    texts = rm.texts(RewardInputs(completions=["3!", "a"], problems=[p, chat]))
    assert texts == ["[user]1+2=[assistant]3!", "[user]q[assistant]a"]  # the reference reply is not scored


def test_judge_score_is_the_label_weighted_expectation_of_its_next_token(judge_path):
    j = JudgeReward("judge", _judge_cfg(judge_path))
    inputs = _inputs(["1+1=", "12+30="], ["2", "a much longer completion"], ["2", "42"])
    got = j(inputs)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(judge_path), AutoTokenizer.from_pretrained(judge_path)
    ids = [tok.convert_tokens_to_ids(x) for x in ("1", "2", "3")]
    for p, c, a, g in zip(inputs.prompts, inputs.completions, inputs.answers, got):
        text = f"Q:{p} A:{c} R:{a} score:"
        with torch.no_grad():  # one unpadded sequence: the hand computation
            z = model(torch.tensor([tok.encode(text, add_special_tokens=False)])).logits[0, -1].double()
        pr = torch.softmax(z, -1)[ids]
        assert g == pytest.approx(float((pr * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum() / pr.sum()),
                                  abs=1e-5)
        assert 1.0 <= g <= 3.0


def test_judge_load_errors_name_the_reward(judge_path, tmp_path):
    with pytest.raises(ValueError, match=r"rewards.models.judge.labels: '10' is 2 tokens"):
        JudgeReward("judge", _judge_cfg(judge_path, labels=["1", "10"]))
    with pytest.raises(ValueError, match=r"rewards.models.judge.rubric: unknown placeholder"):
        JudgeReward("judge", _judge_cfg(judge_path, rubric="{question} {completion}"))
    with pytest.raises(ValueError, match=r"rewards.models.judge.values: expected one value per label"):
        JudgeReward("judge", _judge_cfg(judge_path, labels=["a", "b"]))
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=rf"rewards.models.helpful: cannot load a classifier .*path='{missing}'"):
        RewardModelReward("helpful", RewardModelConfig(path=missing, device="cpu"))
    with pytest.raises(ValueError, match=r"rewards.models.helpful: .* 2-label head"):  # a causal LM is no classifier
        from transformers import AutoModelForSequenceClassification

        m = AutoModelForSequenceClassification.from_pretrained(judge_path, num_labels=2)
        m.save_pretrained(str(tmp_path / "two"))
        import shutil

        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f"{judge_path}/{f}", str(tmp_path / "two" / f))
        RewardModelReward("helpful", RewardModelConfig(path=str(tmp_path / "two"), device="cpu"))


def test_unloadable_reward_model_fails_at_load_run_before_any_model(tmp_path, monkeypatch):
    from fastgrpo import pipeline

    built = []
    monkeypatch.setattr(pipeline, "build_model", lambda *a, **k: built.append(1))
    cfg = load_config(None, ["rollout.engine=torch", "sft_first=false", f"logging.out_dir={tmp_path}/run",
                             f"rewards.models={{helpful: {{path: {tmp_path}/missing, device: cpu}}}}",
                             "rewards.functions=[accuracy, helpful]", "rewards.weights=[1.0, 1.0]"])
    with pytest.raises(ValueError, match=r"rewards.models.helpful: cannot load a classifier"):
        pipeline.run_train(cfg)
    assert not built
    with pytest.raises(ValueError, match=r"rewards.models.helpful.normalize='zscore'"):
        load_config(None, [f"rewards.models={{helpful: {{path: x, normalize: zscore}}}}"])
    with pytest.raises(ValueError, match=r"rewards.accuracy_judge='helpful': expected the name of a kind: judge"):
        load_config(None, [f"rewards.models={{helpful: {{path: x}}}}", "rewards.accuracy_judge=helpful"])


def test_no_parsable_score_is_reported_and_scored_as_configured(judge_path):
    j = JudgeReward("judge", _judge_cfg(judge_path, min_mass=0.99))  # an untrained judge puts ~3/V on the labels
    groups = [[SimpleNamespace(text=t, token_ids=[1], finish_reason="stop") for t in ("a", "b")]]
    probs = [Problem(id=0, prompt="p", answer="")]
    per_fn, total, dropped, errors = score_groups(probs, groups, {"judge": j}, ["judge"], [1.0], error_score=-0.5)
    assert total.tolist() == [[-0.5, -0.5]] and not errors and not dropped
    assert j.metrics() == {"reward/judge/scored": 2.0, "reward/judge/unparsable": 2.0, "reward/judge/raw_mean": 0.0}
    g = JudgeReward("gen", _judge_cfg(judge_path, score="generate", labels=["no", "yes"], values=[0.0, 1.0]))
    assert g.parse("I'd say yes, not no") == 1.0 and g.parse("score 7 of 10") == 7.0 and g.parse("hmm") is None
    texts = [g.render("p", "c", "a")]
    assert g.score_texts(texts) == [g.parse(g.generate(texts)[0])]


def test_a_mostly_unparsable_judge_says_so_on_the_console_once(judge_path):
    j = JudgeReward("loose", _judge_cfg(judge_path, min_mass=0.99))  # every answer below min_mass
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("fastgrpo.rewards", "fastgrpo.reward_output")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # their own handler: a quiet console elsewhere in the session stops propagation
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        for _ in range(3):
            j.score_texts([j.render("p", "c", "a")] * 4)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    console = [r for r in records if r.name == "fastgrpo.rewards"]
    per_call = [r for r in records if r.name == "fastgrpo.reward_output"]  # the run log (quiet_console)
    assert len(console) == 1 and console[0].levelno == logging.WARNING
    assert "judge 'loose': 4 of 4 answers had no parsable score" in console[0].getMessage()
    assert "min_mass=0.99" in console[0].getMessage() and len(per_call) == 3


def test_scores_of_the_wrong_length_are_reported_naming_the_reward(rm_path):
    rm = RewardModelReward("short", RewardModelConfig(path=rm_path, device="cpu"))
    real = rm.raw_scores
    rm.raw_scores = lambda texts: real(texts)[:-1] if len(texts) > 2 else real(texts)  # a broken batch
    groups = [[SimpleNamespace(text=t, token_ids=[1], finish_reason="stop") for t in ("x!", "x")] for _ in range(2)]
    probs = [Problem(id=i, prompt="p", answer="") for i in range(2)]
    per_fn, total, _, errors = score_groups(probs, groups, {"short": rm}, ["short"], [1.0])
    assert not errors  # the batch failed, prompt by prompt (2 texts) it scores
    rm.raw_scores = lambda texts: real(texts)[:-1]
    per_fn, total, _, errors = score_groups(probs, groups, {"short": rm}, ["short"], [1.0], error_score=0.25)
    assert len(errors) == 1 and "reward 'short'" in errors[0] and "returned 1 scores for 2 completions" in errors[0]
    assert "4 of 4 completions failed" in errors[0]  # one line for the reward, with the count
    assert total.tolist() == [[0.25, 0.25], [0.25, 0.25]]


class _Math:
    """A math task's accuracy parts: the extractor (fastgrpo.tasks.math) and its reward fns."""

    name = "math"

    def __init__(self):
        from fastgrpo.tasks.math import make_extractor

        self.extract = make_extractor("tags", "answer")

    def reward_fns(self):
        return {}


def test_accuracy_judge_is_asked_only_about_unparsable_answers(judge_path):
    rcfg = RewardsConfig(functions=["accuracy"], weights=[1.0], accuracy_judge="eq",
                         models={"eq": _judge_cfg(judge_path, labels=["0", "1"],
                                                  rubric="{prompt} ref {answer} got {completion} same?")})
    rewards = build_rewards(rcfg, _Math(), 64)
    acc = rewards["accuracy"]
    assert isinstance(acc.fn, JudgedAccuracy)  # under rewards.timeout (fastgrpo.rewards.worker.TimedReward)
    asked = []
    real = acc.judge.score_texts
    acc.judge.score_texts = lambda texts: asked.extend(texts) or real(texts)
    comps = ["<answer>5</answer>", "<answer>6</answer>", "nothing", "<answer>x+</answer>"]
    got = acc(_inputs(["2+3="] * 4, comps, ["5"] * 4))
    assert got[:3] == [1.0, 0.0, 0.0]  # parsed right, parsed wrong, no answer: the verifier decides
    assert asked == ["2+3= ref 5 got x+ same?"]  # only the one with no SymPy reading
    (p_score,) = real(asked)
    assert got[3] == (1.0 if p_score >= 0.5 else 0.0)
    assert rewards.metrics()["reward/accuracy/judge_asked"] == 1.0
    assert acc(_inputs(["q"], ["<answer>x</answer>"], [""]))[0] is None  # no reference: unverifiable
    assert rewards.metrics()["reward/accuracy/judge_asked"] == 0.0
    with pytest.raises(ValueError, match="accuracy_judge='eq': task arithmetic's accuracy is not the symbolic"):
        from fastgrpo.tasks.arithmetic import ArithmeticTask

        build_rewards(rcfg, ArithmeticTask(10, 10), 64)
