"""User rewards in their worker (fastgrpo/rewards/worker.py) and what counts as a score
(fastgrpo/rewards/faults.py): a hung reward times out and its worker is replaced, a hung model
reward does not block, a `file.py:function` imports in the worker from any working directory,
values that are not real numbers fail their completion with a line naming the reward and the
type, a reward failing on every completion for max_nan_skips rounds gives the one stopping line,
TRL's conversational rewards get completions as message lists, and what a reward prints reaches
the run log."""
import logging
import os
import textwrap
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastgrpo.config import ProcessConfig, RewardsConfig
from fastgrpo.rewards.combine import score_groups
from fastgrpo.rewards.faults import RewardFaults, check_score
from fastgrpo.rewards.registry import RewardInputs, build_rewards, call_reward
from fastgrpo.rewards.worker import OUTPUT_LOGGER, RewardTimeout, TimedReward, user_pool

from reward_helpers import P, Task


def _rc(*names, **kw):
    return RewardsConfig(functions=list(names), weights=[1.0] * len(names), **kw)


def _groups(*texts_per_prompt):
    return [[SimpleNamespace(text=t, token_ids=[1, 2], finish_reason="stop") for t in texts] for texts in texts_per_prompt]


def _module(tmp_path, name, src):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(src))
    return str(path)


def test_only_real_numbers_are_scores():
    for ok, want in [(1, 1.0), (0.5, 0.5), (np.float32(0.25), 0.25), (np.int64(3), 3.0), (torch.tensor(2.0), 2.0),
                     (None, None), (-1e9, -1e9)]:
        assert check_score(ok) == (want, None), ok
    for bad, word in [(True, "bool"), (np.bool_(False), "bool"), (torch.tensor(True), "bool"), ("0.5", "str"),
                      (float("nan"), "non-finite"), (float("inf"), "non-finite"), (1e308, "out of range"),
                      ([1.0], "list"), ({"a": 1}, "dict")]:
        value, why = check_score(bad)
        assert value is None and word in why, (bad, why)


def test_values_that_are_not_scores_fail_their_completion_with_one_line_naming_the_reward():
    def odd(inputs):
        return [True, "0.5", 1e308, 0.5]

    odd.takes_inputs = True
    faults = RewardFaults()
    per_fn, total, dropped, errors = score_groups([P(1), P(2)], _groups(["a", "b"], ["c", "d"]), {"odd": odd},
                                                  ["odd"], [1.0], error_score=-1.0, faults=faults)
    assert per_fn["odd"].tolist() == [[-1.0, -1.0], [-1.0, 0.5]]
    assert len(errors) == 1 and errors[0].startswith("reward 'odd' on prompt id 1: returned a bool")
    assert "3 of 4 completions failed" in errors[0]
    assert faults.metrics()["reward/odd/failed"] == 3.0 and faults.end_round(2) is None


def test_a_reward_failing_on_every_completion_stops_after_max_nan_skips_rounds():
    calls = {"n": 0}

    def flaky(inputs):
        calls["n"] += 1
        return [float("nan")] * len(inputs) if calls["n"] != 2 else [1.0] * len(inputs)

    flaky.takes_inputs = True
    faults, stops = RewardFaults(), []
    for _ in range(4):  # fails, works, fails, fails: the streak restarts after the round that worked
        score_groups([P(1)], _groups(["a", "b"]), {"flaky": flaky}, ["flaky"], [1.0], faults=faults)
        stops.append(faults.end_round(2))
    assert stops[:3] == [None, None, None]
    assert stops[3].startswith("reward 'flaky' failed on every completion for 2 consecutive steps (max_nan_skips=2)")
    assert "non-finite" in stops[3] and "\n" not in stops[3]


def test_a_hung_user_reward_times_out_and_its_worker_is_replaced(tmp_path, monkeypatch):
    path = _module(tmp_path, "slow_rewards", """
        import os, time

        def hang(completions, **kw):
            if any("hang" in c for c in completions):
                time.sleep(3600)
            return [float(os.getpid())] * len(completions)
    """)
    monkeypatch.chdir(tmp_path)
    r = build_rewards(_rc("slow_rewards.py:hang", timeout=1.0), Task(), 64)  # a relative path, as users write it
    monkeypatch.chdir("/")  # the worker imports it by absolute path, from any working directory
    faults = RewardFaults()
    per_fn, _, _, errors = score_groups([P(1), P(2)], _groups(["ok", "ok"], ["hang", "ok"]), r.fns,
                                        ["slow_rewards.py:hang"], [1.0], error_score=-1.0, faults=faults)
    assert per_fn["slow_rewards.py:hang"].tolist() == [[-1.0, -1.0], [-1.0, -1.0]]  # not re-run prompt by prompt
    assert len(errors) == 1 and "timed out after 1 s (rewards.timeout)" in errors[0] and "worker was replaced" in errors[0]
    assert faults.metrics()["reward/slow_rewards.py:hang/timeouts"] == 1.0
    pid = user_pool().worker_pids()[0]
    got = call_reward(r["slow_rewards.py:hang"], RewardInputs(completions=["ok"], problems=[P(1)]))
    assert got == [float(pid)] and pid != os.getpid()  # a fresh worker answers the next call
    assert os.path.exists(path)


def test_timeout_zero_runs_the_reward_in_this_process(tmp_path, monkeypatch):
    _module(tmp_path, "here_rewards", """
        import os

        def pid(completions, **kw):
            return [float(os.getpid())] * len(completions)
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = build_rewards(_rc("here_rewards:pid", timeout=0), Task(), 64)
    assert call_reward(r["here_rewards:pid"], RewardInputs(completions=["x"], problems=[P(1)])) == [float(os.getpid())]


def test_a_hung_model_reward_does_not_block_the_run():
    release = threading.Event()

    def model(inputs):
        if "slow" in inputs.completions[0]:
            release.wait(30)
        return [1.0] * len(inputs)

    timed = TimedReward(model, "rm", 0.2)
    with pytest.raises(RewardTimeout, match="timed out after 0.2 s"):
        timed(RewardInputs(completions=["slow"], problems=[P(1)]))
    with pytest.raises(RewardTimeout, match="previous call is still running"):  # never two calls on one model
        timed(RewardInputs(completions=["fast"], problems=[P(1)]))
    release.set()
    timed._running.join(5)
    assert timed(RewardInputs(completions=["fast"], problems=[P(1)])) == [1.0] and timed.timeouts == 2


def test_a_hung_process_scorer_times_out(tmp_path):
    path = _module(tmp_path, "slow_scorer", """
        import time

        def score(prompt, steps, answer):
            if "hang" in steps[0]:
                time.sleep(3600)
            return [1.0] * len(steps)
    """)
    rc = RewardsConfig(functions=["process"], weights=[1.0], timeout=1.0,
                       process=ProcessConfig(scorer=f"{path}:score", delimiter="\n"))
    r = build_rewards(rc, Task(), 64)
    per_fn, _, _, errors = score_groups([P(1)], _groups(["ok\nfine", "ok"]), r.fns, ["process"], [1.0])
    assert per_fn["process"].tolist() == [[1.0, 1.0]]  # the worker path scores as the in-process one
    per_fn, _, _, errors = score_groups([P(1)], _groups(["hang\nx", "ok"]), r.fns, ["process"], [1.0], error_score=-1.0)
    assert per_fn["process"].tolist() == [[-1.0, -1.0]] and "timed out after 1 s" in errors[0]


def test_trl_conversational_rewards_get_messages_on_chat_data():
    """TRL's own rewards (trl.rewards) read `completion[0]["content"]`: on a chat row fastgrpo hands
    them message lists, as TRL's GRPOTrainer does, and the dataset's columns (here `solution`)."""
    r = build_rewards(_rc("trl.rewards:think_format_reward", "trl.rewards:accuracy_reward"), Task(), 64)
    row = {"prompt": [{"role": "user", "content": "What is 1/3?"}], "solution": r"\frac{1}{3}"}
    p = P(0, prompt="<|user|>What is 1/3?<|assistant|>", answer="", row=row)
    comps = ["<think>\nthirds\n</think>\nSo \\boxed{\\frac{1}{3}}", "no thinking: \\boxed{\\frac{1}{2}}"]
    per_fn, _, _, errors = score_groups([p], _groups(comps), r.fns, list(r.keys()), [1.0, 1.0])
    assert not errors
    assert per_fn["trl.rewards:think_format_reward"].tolist() == [[1.0, 0.0]]
    assert per_fn["trl.rewards:accuracy_reward"].tolist() == [[1.0, 0.0]]


def test_prompts_and_completions_in_the_datasets_own_form(tmp_path, monkeypatch):
    _module(tmp_path, "form_rewards", """
        def form(prompts, completions, messages=None, **kw):
            assert "prompt" not in kw and "completion" not in kw  # TRL leaves these columns out
            return [float(isinstance(c, list) and c[0]["role"] == "assistant" and isinstance(p, list)
                          and p[-1]["role"] == "user") for p, c in zip(prompts, completions)]
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    r = build_rewards(_rc("form_rewards:form"), Task(), 64)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "reference"}]}
    inp = RewardInputs(completions=["a", "b"], problems=[P(0, row=chat)] * 2)
    assert call_reward(r["form_rewards:form"], inp) == [1.0, 1.0]  # messages without the reference reply
    plain = RewardInputs(completions=["a"], problems=[P(0, row={"prompt": "hi"})])
    assert call_reward(r["form_rewards:form"], plain) == [0.0]  # strings on plain data


def test_what_a_user_reward_prints_reaches_the_run_log(tmp_path, capfd):
    path = _module(tmp_path, "chatty_rewards", """
        import warnings

        def chatty(completions, **kw):
            print("chatty sees", len(completions), "completions")
            warnings.warn("chatty is deprecated")
            return [0.0] * len(completions)
    """)
    log = tmp_path / "log.txt"
    handler = logging.FileHandler(log)
    lg = logging.getLogger(OUTPUT_LOGGER)
    level = lg.level
    lg.addHandler(handler)  # what fastgrpo.logs.console.quiet_console does for a run
    lg.setLevel(logging.INFO)
    try:
        r = build_rewards(_rc(f"{path}:chatty"), Task(), 64)
        for _ in range(2):
            call_reward(r[f"{path}:chatty"], RewardInputs(completions=["a", "b"], problems=[P(1)] * 2))
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
        handler.close()
    text = log.read_text()
    assert text.count("chatty sees 2 completions") == 2 and text.count("chatty is deprecated") == 1  # a warning once
    out, err = capfd.readouterr()
    assert "chatty" not in out + err
    from fastgrpo.logs.console import LIBRARY_LOGGERS

    assert OUTPUT_LOGGER in LIBRARY_LOGGERS


def test_a_signal_during_an_in_process_reward_is_announced_on_the_console(tmp_path, capsys):
    """rewards.timeout=0: the reward runs here with its stdout captured for the run log; a SIGTERM
    arriving meanwhile still prints the trainer's "stopping after step N" line on the console
    (it used to end up in log.txt among the reward's output), and the handlers are restored."""
    import signal

    from fastgrpo.runs.folder import graceful_signals

    path = _module(tmp_path, "signalled_rewards", """
        import os, signal

        def signalled(completions, **kw):
            print("reward output")
            os.kill(os.getpid(), signal.SIGTERM)
            return [0.0] * len(completions)
    """)
    log = tmp_path / "log.txt"
    handler = logging.FileHandler(log)
    lg = logging.getLogger(OUTPUT_LOGGER)
    level = lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    stops = []
    try:
        r = build_rewards(_rc(f"{path}:signalled", timeout=0), Task(), 64)
        with graceful_signals(lambda s: (stops.append(s), print("[fastgrpo] SIGTERM: stopping after step 1"))):
            installed = signal.getsignal(signal.SIGTERM)
            call_reward(r[f"{path}:signalled"], RewardInputs(completions=["a"], problems=[P(1)]))
            assert signal.getsignal(signal.SIGTERM) is installed  # the wrapper is gone after the call
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
        handler.close()
    assert stops == [signal.SIGTERM]
    out = capsys.readouterr().out
    assert "stopping after step 1" in out and "reward output" not in out, out
    text = log.read_text()
    assert "reward output" in text and "stopping after step" not in text, text
