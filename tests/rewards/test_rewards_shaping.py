import pytest

from fastgrpo.rewards import (KimiLengthGate, RewardManager, combine_rewards, format_reward, kimi_length_reward,
                              language_reward, overlong_penalty)


def test_kimi_seed_example():
    lengths = [512, 1024, 2048, 4096, 512, 4096]
    correct = [True, True, True, True, False, False]
    r = kimi_length_reward(lengths, correct)
    assert r[0] == pytest.approx(0.5) and r[3] == pytest.approx(-0.5)
    assert r[5] == pytest.approx(-0.5) and r[4] == 0.0
    assert r[1] == pytest.approx(0.5 - 512 / 3584)


def test_kimi_equal_lengths_groups_and_gate():
    assert kimi_length_reward([100, 100], [True, False]) == [0.0, 0.0]
    r = kimi_length_reward([10, 20, 10, 30], [True] * 4, groups=[0, 0, 1, 1])
    assert r == [0.5, -0.5, 0.5, -0.5]
    gate = KimiLengthGate(min_step=100, min_accuracy=0.3)
    assert kimi_length_reward([1, 9], [False, False], gate=gate, step=1) == [0.0, 0.0]
    assert not gate.active
    assert kimi_length_reward([1, 9], [True, False], gate=gate, step=2) == [0.5, -0.5]  # accuracy 0.5 ≥ 0.3
    assert kimi_length_reward([1, 9], [False, False], gate=gate, step=3)[1] == -0.5  # sticky
    by_step = KimiLengthGate(min_step=10, min_accuracy=None)
    assert not by_step.update(9, 1.0) and by_step.update(10, 0.0)
    restored = KimiLengthGate()
    restored.load_state_dict(gate.state_dict())
    assert restored.active
    with pytest.raises(ValueError, match="lengths"):
        kimi_length_reward([-1], [True])


def test_overlong_penalty():
    assert overlong_penalty([100, 768, 896, 1024, 2000], max_length=1024, cache_length=256) == [0.0, 0.0, -0.5, -1.0,
                                                                                             -1.0]
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty([1], 10, 20)


def test_format_strict_and_lenient():
    good = "<think>6 times 7</think>\n<answer>42</answer>"
    cases = [good, "<think></think><answer>42</answer>", "<answer>42</answer>", "<think>a</think>",
             "<think>a</think><answer>42</answer> trailing", "<think>a<think>b</think><answer>1</answer>",
             "prefix <think>a</think><answer>42</answer>", "", None, b"\xff", "<think>" * 10000]
    strict = format_reward(cases)
    assert strict == [1.0] + [0.0] * (len(cases) - 1)
    lenient = format_reward(cases, strict=False)
    assert lenient[0] == 1.0 and lenient[4] == 1.0 and lenient[6] == 1.0 and lenient[2] == 0.0
    assert format_reward(["<think>x</think> 42"], answer_tag="") == [1.0]
    _, why = format_reward(["<think> </think><answer>1</answer>"], return_reasons=True)
    assert why == ["no_reasoning"]
    with pytest.raises(ValueError, match="think_tag"):
        format_reward(["x"], think_tag="<think>")


def test_language_reward():
    en = "<think>First add the two numbers then divide</think><answer>4</answer>"
    mixed = "<think>First 先 加 then 除</think>"
    zh = "<think>先把两个数相加</think>"
    r = language_reward([en, mixed, zh, "", None])
    assert r[0] == 1.0 and r[1] == pytest.approx(2 / 5) and r[2] == 0.0 and r[3] == 0.0 and r[4] == 0.0
    assert language_reward([zh], language="zh") == [1.0]
    with pytest.raises(ValueError, match="language"):
        language_reward(["x"], language="klingon")


def test_combine_rewards():
    out = combine_rewards({"math": [1.0, 0.0, None], "format": [1.0, 1.0, 1.0]}, {"math": 1.0, "format": 0.1},
                          reasons={"math": [None, "wrong", "gold_unparsable"]})
    assert out.total == [pytest.approx(1.1), pytest.approx(0.1), None]
    assert out.metrics["reward/math/mean"] == 0.5
    assert out.metrics["reward/math/reason/wrong"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="weights"):
        combine_rewards({"math": [1.0]}, {"fmt": 1.0})


def test_reward_manager_with_arithmetic_demo_format(pool):
    comps = ["<think>6*7=42</think><answer>42</answer>", "<think>6*7=41</think><answer>41</answer>", "42"]
    mgr = RewardManager({"math": 1.0, "format": 0.1, "kimi_length": 0.2}, pool=pool)
    out = mgr.score(comps, answers=["42"] * 3, lengths=[10, 20, 30], step=0)
    assert out.components["math"] == [1.0, 0.0, 1.0]
    assert out.components["format"] == [1.0, 1.0, 0.0]
    assert out.components["kimi_length"] == [0.5, 0.0, -0.5]  # accuracy 2/3 ≥ 0.3 switches the gate on
    assert out.total == [pytest.approx(1.2), pytest.approx(0.1), pytest.approx(0.9)]
    assert mgr.state_dict() == {"kimi_gate": {"active": True}}
    mgr.close()  # does not close a pool it does not own
    assert pool.map(abs, [(-1,)], timeout=5.0)[0].value == 1
    with pytest.raises(ValueError, match="answers"):
        mgr.score(comps)
    with pytest.raises(ValueError, match="options"):
        RewardManager({"math": 1.0}, options={"format": {"strict": False}}, pool=pool)
    with pytest.raises(ValueError, match="weights"):
        RewardManager({"mathh": 1.0}, pool=pool)


def test_score_groups_non_finite_and_none():
    """The trainer's scoring path: a None score and a NaN both count `error_score`, in
    each reward and in the weighted total (the same rule as combine_rewards(none_score=...))."""
    from fastgrpo.rewards.combine import score_groups

    class C:
        def __init__(self, text):
            self.text = text

    class P:
        def __init__(self, i):
            self.id, self.answer = i, "1"

    fns = {"accuracy": lambda c, a: [float("nan") if t == "bad" else (None if t == "none" else 1.0) for t in c],
           "format": lambda c, a: [0.5] * len(c)}
    groups = [[C("ok"), C("none")], [C("bad"), C("ok")]]
    per_fn, total, dropped, errors = score_groups([P(7), P(8)], groups, fns, ["accuracy", "format"], [1.0, 2.0],
                                                  error_score=-2.0)
    # the NaN fails its own completion only (fastgrpo.rewards.faults), not its group
    assert per_fn["accuracy"].tolist() == [[1.0, -2.0], [-2.0, 1.0]]
    assert total.tolist() == [[2.0, -1.0], [-1.0, 2.0]]
    assert len(errors) == 1 and "prompt id 8" in errors[0] and "non-finite" in errors[0] and not dropped
    _, _, dropped, _ = score_groups([P(7), P(8)], groups, fns, ["accuracy"], [1.0], on_error="drop")
    assert dropped == {1}
    mixed = combine_rewards({"a": [1.0, None]}, {"a": 2.0}, none_score=-2.0)
    assert mixed.total == [2.0, -4.0] and mixed.components["a"] == [1.0, None]
