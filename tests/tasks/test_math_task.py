"""Math tasks: each answer format on completions and on references (GSM8K's `####` solutions
included), Math-Verify accuracy through math_reward's pool, references checked at load."""
import json

import pytest

from fastgrpo.config import DataConfig
from fastgrpo.tasks.build import build_task
from fastgrpo.tasks.math import make_extractor, reference_answer

GSM = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("fmt, text, want", [
    ("tags", "<think>2+2</think><answer>4</answer> then 5", "4"),
    ("tags", "<answer>so \\boxed{7}</answer>", "7"),
    ("tags", "no tags, 4", None),
    ("boxed", "so \\boxed{\\frac{1}{2}} and 3", "\\frac{1}{2}"),
    ("boxed", "4", None),
    ("gsm8k", "reasoning 3\n#### 1,234\n", "1234"),
    ("gsm8k", "the answer is 3", None),
    ("gsm8k", "#### $1,000 in total", "1000"),
    ("gsm8k", "#### \\frac{1}{2}", "\\frac{1}{2}"),
    ("gsm8k", "#### 3/4", "3/4"),
    ("last_number", "first 3 then -4.5, ok", "-4.5"),
    ("last_number", "1,000 apples", "1000"),
    ("regex:Final: (\\S+)", "Final: 3\nFinal: 9", "9"),
    ("auto", "<answer>5</answer> \\boxed{6}", "5"),
    ("auto", "x \\boxed{6} #### 7", "6"),
    ("auto", "x #### 7 then 8", "7"),
    ("auto", "so the answer is \\frac{1}{2}.", "\\frac{1}{2}"),
    ("auto", "3 and then 8", "8"),
    ("auto", "no number", None),
])
def test_extractors(fmt, text, want):
    assert make_extractor(fmt)(text) == want


def test_custom_tag_and_bad_formats():
    assert make_extractor("tags", "final")("<final>3</final>") == "3"
    with pytest.raises(ValueError, match=r"data.answer_format='regex:.*': the pattern needs a capture group"):
        make_extractor("regex:\\d+")
    with pytest.raises(ValueError, match=r"data.answer_format='regex:\(': not a valid regular expression"):
        make_extractor("regex:(")
    with pytest.raises(ValueError, match=r"data.answer_format='latex'"):
        make_extractor("latex")


@pytest.mark.parametrize("fmt, ref, want", [
    ("gsm8k", GSM, "72"),
    ("auto", GSM, "72"),
    ("gsm8k", "72", "72"),  # a bare answer is taken whole
    ("boxed", "The answer is \\boxed{x^2+1}.", "x^2+1"),
    ("auto", "\\frac{1}{2}", "\\frac{1}{2}"),
    ("auto", "<answer>3</answer>", "3"),
    ("tags", "5 apples", "5 apples"),
    ("auto", "We add them.\nSo the answer is 12.", "12"),
    ("last_number", "\\frac{3}{4}", "\\frac{3}{4}"),
    ("auto", 4, "4"),
])
def test_reference_answers(fmt, ref, want):
    assert reference_answer(ref, fmt, "answer", "f:1") == want


@pytest.mark.parametrize("fmt, ref, match", [
    ("gsm8k", "They sold some clips in May.\nThen more in June.", r"f:3: column 'answer': the reference .* holds no "
                                                                   r"answer that answer_format=gsm8k extracts"),
    ("auto", "", r"f:3: column 'answer' is empty"),
    ("auto", None, r"f:3: column 'answer' is None"),
    ("auto", ["1"], r"f:3: column 'answer' holds list"),
])
def test_reference_errors(fmt, ref, match):
    with pytest.raises(ValueError, match=match):
        reference_answer(ref, fmt, "answer", "f:3")


def _write(tmp_path, rows):
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


def test_gsm8k_task_accuracy(tmp_path, pool):
    rows = [{"question": "Natalia ...?", "answer": GSM}, {"question": "Half of 1?", "answer": "\\frac{1}{2}"}]
    task = build_task(DataConfig(path=_write(tmp_path, rows), columns={"prompt": "question"}, answer_format="gsm8k"),
                      pool=pool)
    assert [q.answer for q in task.train] == ["72", "\\frac{1}{2}"] and task.name == "math"
    acc = task.reward_fns(pool)["accuracy"]
    comps = ["so 72 clips\n#### 72", "#### 71", "72 without the marker", "#### 0.5"]
    assert acc(comps, ["72", "72", "72", "\\frac{1}{2}"]) == [1.0, 0.0, 0.0, 1.0]


def test_boxed_task_and_unparsable_reference(tmp_path, pool):
    rows = [{"prompt": "p", "answer": "The result is \\boxed{\\sqrt{2}}."}]
    task = build_task(DataConfig(path=_write(tmp_path, rows), answer_format="boxed"), pool=pool)
    assert task.train[0].answer == "\\sqrt{2}"
    assert task.reward_fns(pool)["accuracy"](["\\boxed{2^{1/2}}", "\\boxed{1.4}"], ["\\sqrt{2}"] * 2) == [1.0, 0.0]
    bad = [{"prompt": "p", "answer": "1"}, {"prompt": "q", "answer": "\\boxed{}}{"}]
    with pytest.raises(ValueError, match=r"m\.jsonl:2: column 'answer'"):
        build_task(DataConfig(path=_write(tmp_path, bad), answer_format="boxed"), pool=pool)
