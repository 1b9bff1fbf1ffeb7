import logging
import time

import pytest

from fastgrpo.rewards import extract_answer, math_reward

EQUIV = [
    ("<answer>1/2</answer>", "0.5"),
    ("<answer>0.5</answer>", "\\frac{1}{2}"),
    ("\\boxed{\\frac{1}{2}}", "1/2"),
    ("<answer>x=2, x=3</answer>", "\\{2, 3\\}"),
    ("<answer>(1,2]</answer>", "(1,2]"),
    ("<answer>(x+1)^2</answer>", "x^2+2x+1"),
    ("<answer>5 cm</answer>", "5"),
    ("<answer>\\text{5 cm}</answer>", "5"),
    ("<answer>50%</answer>", "50"),
    ("Some work.\nAnswer: 12", "12"),
    ("I think it is 3 then 7", "7"),
    ("<think>6*7</think><answer>42</answer>", "42"),
    ("<answer>\\boxed{3}</answer>", "\\boxed{3}"),
]
NOT_EQUIV = [
    ("<answer>1/3</answer>", "1/2"),
    ("<answer>(1,2)</answer>", "(1,2]"),
    ("<answer>x^2+2x+2</answer>", "(x+1)^2"),
    ("<answer>50%</answer>", "0.5"),
    ("<answer>2</answer>", "\\{2, 3\\}"),
    ("<answer>2x</answer>", "2"),
    ("<answer>3 x</answer>", "3"),
]


def test_equivalences(pool):
    scores, why = math_reward([c for c, _ in EQUIV], [a for _, a in EQUIV], pool=pool, return_reasons=True)
    bad = [(c, a, r) for (c, a), s, r in zip(EQUIV, scores, why) if s != 1.0]
    assert not bad, f"should be equivalent: {bad}"


def test_non_equivalences(pool):
    scores, why = math_reward([c for c, _ in NOT_EQUIV], [a for _, a in NOT_EQUIV], pool=pool, return_reasons=True)
    assert scores == [0.0] * len(NOT_EQUIV), list(zip(NOT_EQUIV, scores))
    assert set(why) == {"wrong"}


def test_percent_as_fraction_when_configured(pool):
    assert math_reward(["<answer>50%</answer>"] * 2, ["0.5", "50"], pool=pool, percent_as_fraction=True) == [1.0, 1.0]


def test_extraction_priority_and_fallback():
    assert extract_answer("\\boxed{1} then <answer>2</answer>") == "2"
    assert extract_answer("<answer>so \\boxed{7}</answer>") == "7"
    assert extract_answer("\\boxed{\\frac{a}{b}} x") == "\\frac{a}{b}"
    assert extract_answer("<answer>3") == "3"  # unbalanced tag: falls back to the last number
    assert extract_answer("no digits here") is None
    assert extract_answer("it is 5", last_number_fallback=False) is None
    assert extract_answer("<answer>9</answer>", answer_tag="") == "9"


def test_hostile_strings_get_numbers(pool):
    junk = ["", "\x00\xff" * 100, b"\xff\xfe<answer>3</answer>", None, 12, "<answer><answer></answer>",
            "</answer>3<answer>", "\\boxed{" * 1000, "x" * (1 << 20), "<think>" * 5000 + "3"]
    scores, why = math_reward(junk, ["3"] * len(junk), pool=pool, return_reasons=True, timeout=3.0)
    assert all(isinstance(s, float) for s in scores), scores
    assert scores[2] == 1.0 and scores[-1] == 1.0
    assert why[3] == "bad_input" and why[0] == "no_answer"


def test_pathological_math_returns_within_timeout(pool):
    timeout = 2.0
    cases = ["<answer>10**10**10</answer>", "<answer>" + "(" * 100_000 + "1" + ")" * 100_000 + "</answer>",
             "<answer>" + "9" * (1 << 20) + "</answer>", "<answer>10^{10^{10^{10}}}</answer>"]
    t0 = time.monotonic()
    scores, why = math_reward(cases, ["3"] * len(cases), pool=pool, timeout=timeout, max_answer_chars=None,
                              return_reasons=True)
    elapsed = time.monotonic() - t0
    # 4 items on 2 workers: two rounds of at most `timeout` each, plus respawn
    assert elapsed < 2 * timeout + 2.0, (elapsed, why)
    assert scores == [0.0] * 4, (scores, why)
    # the pool is still healthy afterwards
    assert math_reward(["<answer>3</answer>"], ["3"], pool=pool) == [1.0]


def test_long_answer_capped_without_worker(pool):
    scores, why = math_reward(["<answer>" + "1" * 5000 + "</answer>"], ["1"], pool=pool, return_reasons=True)
    assert scores == [0.0] and why == ["answer_too_long"]


def test_unparsable_gold_is_none_and_reported_once(pool, caplog):
    caplog.set_level(logging.WARNING, logger="fastgrpo.rewards")
    golds = ["\\frac{", "\\frac{", "", "4"]
    scores, why = math_reward(["<answer>4</answer>"] * 4, golds, pool=pool, example_ids=["q1", "q1", "q2", "q3"],
                              return_reasons=True)
    assert scores == [None, None, None, 1.0]
    assert why[:3] == ["gold_unparsable"] * 3
    math_reward(["<answer>4</answer>"], ["\\frac{"], pool=pool, example_ids=["q1"])
    msgs = [r.getMessage() for r in caplog.records if "data error" in r.getMessage()]
    assert len([m for m in msgs if "\\\\frac{" in m]) == 1, msgs
    assert any("q1" in m for m in msgs) and any("q2" in m for m in msgs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="answers"):
        math_reward(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="timeout"):
        math_reward(["a"], ["1"], timeout=0)


def test_callable_from_a_trainer_thread(pool):
    # Math-Verify's signal.alarm fails outside the main thread; the pool keeps it in workers.
    import threading

    out = {}
    t = threading.Thread(target=lambda: out.update(r=math_reward(["<answer>1/2</answer>"], ["0.5"], pool=pool)))
    t.start()
    t.join(30)
    assert out["r"] == [1.0]
