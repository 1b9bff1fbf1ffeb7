"""Rewards by name from the config (fastgrpo/rewards/registry.py): every name builds, options
from the config reach the reward, a user's module:function in TRL's signature or the older
(completions, answers) one, the Kimi gate's state, and every bad entry failing at load."""
import sys
import textwrap
from types import SimpleNamespace

import pytest

from fastgrpo.config import RewardsConfig, load_config
from fastgrpo.rewards.combine import score_groups
from fastgrpo.rewards.registry import RewardInputs, build_rewards, call_reward

from reward_helpers import P, Task


def _inputs(texts, problems, lengths=None, G=None):
    return RewardInputs(completions=list(texts), problems=list(problems), lengths=lengths or [len(t) for t in texts],
                        truncated=[False] * len(texts), completion_ids=[[1] * len(t) for t in texts],
                        group_size=G or len(texts))


def _rc(*names, **kw):
    return RewardsConfig(functions=list(names), weights=[1.0] * len(names), **kw)


def test_format_tags_from_config():
    good = "<reason>a</reason><final>3</final>"
    r = build_rewards(_rc("format", format_think_tag="reason", format_answer_tag="final"), Task(), 64)
    p = P(0, "q", "3")
    assert call_reward(r["format"], _inputs([good, "<think>a</think><answer>3</answer>"], [p, p])) == [1.0, 0.0]


def test_language_overlong_and_unknown_language():
    r = build_rewards(_rc("language", "overlong", overlong_cache=4), Task(), 8)
    p = P(0, "q", "3")
    inp = _inputs(["<think>plain english words</think>", "<think>中文的推理过程</think>", "x"], [p] * 3, lengths=[4, 6, 8])
    assert call_reward(r["language"], inp)[:2] == [1.0, 0.0]
    assert call_reward(r["overlong"], inp) == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError):
        build_rewards(_rc("language", language="klingon"), Task(), 8)
    with pytest.raises(ValueError, match="overlong_cache"):
        build_rewards(_rc("overlong", overlong_cache=9), Task(), 8)


def test_kimi_length_gate_opens_on_accuracy_and_is_checkpointed():
    r = build_rewards(_rc("accuracy", "kimi_length", kimi_min_accuracy=0.5), Task(), 64)
    p = P(0, "q", "7")
    wrong = _inputs(["no", "nope", "nooooo", "n"], [p] * 4, lengths=[2, 4, 6, 8], G=4)
    wrong.scores["accuracy"] = call_reward(r["accuracy"], wrong)
    assert call_reward(r["kimi_length"], wrong) == [0.0] * 4 and not r.gate.active  # accuracy 0 < 0.5: off
    right = _inputs(["7", "7 7", "7 7 7", "x"], [p] * 4, lengths=[2, 4, 6, 8], G=4)
    right.scores["accuracy"] = call_reward(r["accuracy"], right)  # 3 of 4 right: the gate opens
    out = call_reward(r["kimi_length"], right)
    assert r.gate.active and out[0] == pytest.approx(0.5) and out[3] == pytest.approx(-0.5)
    again = build_rewards(_rc("accuracy", "kimi_length", kimi_min_accuracy=0.5), Task(), 64)
    again.load_state_dict(r.state_dict())
    assert again.gate.active


def test_user_function_trl_signature_and_columns(tmp_path, monkeypatch):
    mod = tmp_path / "my_rewards.py"
    mod.write_text(textwrap.dedent("""
        def trl_style(prompts, completions, completion_ids, difficulty, **kwargs):
            assert len(prompts) == len(completions) == len(completion_ids) == len(difficulty)
            assert "answer" in kwargs and "trainer_state" not in kwargs or True
            return [float(d == "hard") + 0.5 * (a in c) for c, d, a in zip(completions, difficulty, kwargs["answer"])]

        def plain(completions, answers):
            return [float(len(c)) for c in completions]

        def strict_kw(completions):
            return [1.0] * len(completions)

        NOT_A_FN = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    r = build_rewards(_rc("my_rewards:trl_style", "my_rewards:plain", f"{mod}:strict_kw"), Task(), 64)
    p1 = P(1, "q1", "4", row={"difficulty": "hard"})
    p2 = P(2, "q2", "5", row={"difficulty": "easy"})
    inp = _inputs(["4", "x", "5", "5"], [p1, p1, p2, p2])
    assert call_reward(r["my_rewards:trl_style"], inp) == [1.5, 1.0, 0.5, 0.5]
    assert call_reward(r["my_rewards:plain"], inp) == [1.0] * 4
    assert call_reward(r[f"{mod}:strict_kw"], inp) == [1.0] * 4
    with pytest.raises(ValueError, match="has no callable 'NOT_A_FN'"):
        build_rewards(_rc("my_rewards:NOT_A_FN"), Task(), 64)
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        build_rewards(_rc("no_such_module_xyz:f"), Task(), 64)
    sys.modules.pop("my_rewards", None)


def test_user_function_that_raises_or_miscounts_is_reported_with_the_prompt_id(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(textwrap.dedent("""
        def raises_on_five(completions, answers):
            if "5" in answers:
                raise RuntimeError("boom")
            return [1.0] * len(completions)

        def wrong_length(completions, answers):
            return [1.0]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    r = build_rewards(_rc("bad_rewards:raises_on_five", "bad_rewards:wrong_length"), Task(), 64)
    probs = [P(1, "q1", "4", key="row-a"), P(2, "q2", "5", key="row-b")]
    groups = [[SimpleNamespace(text="4", token_ids=[1], finish_reason="stop")] * 2,
              [SimpleNamespace(text="5", token_ids=[1], finish_reason="stop")] * 2]
    per_fn, total, dropped, errors = score_groups(probs, groups, r, ["bad_rewards:raises_on_five"], [1.0],
                                                  error_score=-1.0)
    assert per_fn["bad_rewards:raises_on_five"].tolist() == [[1.0, 1.0], [-1.0, -1.0]]
    assert len(errors) == 1 and "prompt id row-b" in errors[0] and "boom" in errors[0]
    per_fn, _, dropped, errors = score_groups(probs, groups, r, ["bad_rewards:wrong_length"], [1.0], on_error="drop")
    assert dropped == {0, 1} and all("returned 1 scores for 2" in e for e in errors)
    sys.modules.pop("bad_rewards", None)


def test_scores_of_earlier_rewards_are_visible_to_later_ones():
    seen = {}

    def later(inputs):
        seen["acc"] = list(inputs.scores["accuracy"])
        return [0.0] * len(inputs)

    later.takes_inputs = True
    fns = {"accuracy": Task().reward_fns()["accuracy"], "later": later}
    probs = [P(1, "q", "4")]
    groups = [[SimpleNamespace(text="4", token_ids=[1], finish_reason="stop"),
               SimpleNamespace(text="x", token_ids=[1, 2], finish_reason="length")]]
    score_groups(probs, groups, fns, ["accuracy", "later"], [1.0, 1.0])
    assert seen["acc"] == [1.0, 0.0]


def test_code_reward_needs_tests_and_scores_them():
    r = build_rewards(_rc("code"), Task(), 64)
    p = P(0, "write add", "", tests="assert add(2, 3) == 5")
    inp = _inputs(["```python\ndef add(a, b):\n    return a + b\n```", "```python\ndef add(a, b):\n    return a - b\n```"],
                  [p, p])
    assert call_reward(r["code"], inp) == [1.0, 0.0]
    with pytest.raises(ValueError, match="tests"):
        call_reward(r["code"], _inputs(["x"], [P(1, "q", "1")]))


def test_bad_reward_entries_fail_at_config_load():
    # the library's names and the task's own are known when the rewards are built (before any model)
    with pytest.raises(ValueError, match=r"rewards.functions\[1\]='acuracy'.*one of \['accuracy'"):
        build_rewards(_rc("format", "acuracy"), Task(), 64)
    # the config itself refuses what cannot be a name, and a typo is not a weights-count mismatch
    with pytest.raises(ValueError, match=r"rewards.functions\[0\]='no such'"):
        load_config(None, ["rewards.functions=[no such]"])
    with pytest.raises(ValueError, match="rewards.weights"):
        load_config(None, ["rewards.functions=[accuracy, format]"])
    with pytest.raises(ValueError, match="rewards.weights"):
        load_config(None, ["rewards.functions=[accuracy, format]"])
    with pytest.raises(ValueError, match="accuracy reward"):
        build_rewards(_rc("accuracy"), SimpleNamespace(name="none", reward_fns=lambda: {}), 64)


def test_a_module_beside_the_config_file_imports_from_any_working_directory(tmp_path, monkeypatch):
    """`my_rewards:brevity` next to the config file (issue 34: ModuleNotFoundError unless
    PYTHONPATH=.): looked up in the config file's folder, then the working directory, in this
    process and in the user-reward worker (rewards.timeout > 0); a failure names both forms."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the found folder stays on sys.path: undone here
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "i34_rewards.py").write_text("def brevity(completions, **kw):\n    return [1.0 / len(c) for c in completions]\n")
    (conf / "run.yaml").write_text("rewards:\n  functions: ['i34_rewards:brevity', 'i34_rewards.py:brevity']\n"
                                   "  weights: [1.0, 1.0]\n  timeout: 30\n")
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load_config(str(conf / "run.yaml"))
    assert cfg.config_dir == str(conf)
    r = build_rewards(cfg.rewards, Task(), 64, cfg.config_dir)
    p = P(0, "q", "4")
    for name in cfg.rewards.functions:  # both forms, scored in the worker process
        assert call_reward(r[name], _inputs(["ab", "abcd"], [p, p])) == [0.5, 0.25]
    with pytest.raises(ValueError, match=r"cannot import 'nowhere_i34'.*in .*conf and .*: write 'nowhere_i34:f' with "
                                         r"nowhere_i34.py in one of those folders, or 'path/to/nowhere_i34.py:f'"):
        build_rewards(_rc("nowhere_i34:f"), Task(), 64, str(conf))
    sys.modules.pop("i34_rewards", None)
