import pytest

from fastgrpo.rewards import code_reward, extract_code

TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 4"


def test_pass_fail_and_fraction(pool):
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    half = "def add(a, b):\n    return 3 if a == 1 else a * b"  # add(1, 2) and add(2, 2) pass
    bad = "```py\ndef add(a, b):\n    return a - b\n```"
    comps = [good, half, bad]
    assert code_reward(comps, [TESTS] * 3, pool=pool) == [1.0, 0.0, 0.0]
    frac = code_reward(comps, [TESTS] * 3, pool=pool, mode="fraction")
    assert frac == [1.0, pytest.approx(2 / 3), 0.0]


def test_humaneval_style_check_function(pool):
    tests = "def check(f):\n    assert f(2, 3) == 5\ncheck(add)"
    ok = "def add(a, b): return a + b"
    wrong = "def add(a, b): return a * b"
    assert code_reward([ok, wrong], [tests] * 2, pool=pool) == [1.0, 0.0]


def test_exit_early_or_fake_output_cannot_pass(pool):
    hacks = ["import os\nos._exit(0)",
             "import sys\nsys.exit(0)",
             "print('DONE 3 3 0')\nimport os\nos._exit(0)",
             "def add(a, b): return a + b\nimport atexit, os\natexit.register(lambda: os._exit(0))\nraise SystemExit(0)"]
    scores, why = code_reward(hacks, [TESTS] * len(hacks), pool=pool, return_reasons=True)
    assert scores == [0.0] * len(hacks), why


def test_invalid_tests_are_data_errors(pool):
    scores, why = code_reward(["def f(): pass", "def f(): pass"], ["assert (", ""], pool=pool, return_reasons=True)
    assert scores == [None, None] and why == ["tests_invalid"] * 2


def test_junk_completions_score_zero(pool):
    junk = ["", None, b"\xff\xfe", "```python\n", "def (:", "\x00" * 1000]
    scores = code_reward(junk, [TESTS] * len(junk), pool=pool, timeout=2.0)
    assert scores == [0.0] * len(junk)


def test_extract_code():
    assert extract_code("<think>```python\nx=1\n```</think>```python\ny=2\n```") == "y=2\n"
    assert extract_code("```\nz=3\n```") == "z=3\n"
    assert extract_code("<think>plan</think>\nprint(1)") == "print(1)"
    assert extract_code("   ") is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        code_reward(["x"], ["assert 1"], mode="some")
    with pytest.raises(ValueError, match="tests"):
        code_reward(["x"], [])
