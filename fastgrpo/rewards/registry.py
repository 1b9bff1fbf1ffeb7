"""Rewards by name: what `rewards.functions` in a run config can list, built once per run
(`build_rewards`). The input type and the reward-function protocol live in
fastgrpo/rewards/inputs.py (re-exported here).
"""
from __future__ import annotations

from typing import Callable, Dict

from fastgrpo.config import check_reward_name  # the names live with the config schema
from fastgrpo.rewards.inputs import (RewardInputs, call_reward, import_reward, inputs_reward,  # noqa: F401
                                     user_reward)


class Rewards:
    """The rewards of a run: name → `@inputs_reward` callable, built once from the config and the
    task (`build_rewards`); holds the state some rewards keep (the Kimi gate), checkpointed with
    `state_dict`; `process` is the run's `ProcessReward` (rewards.process), None without one;
    `verifier` is the task's accuracy (what a held-out evaluation scores, whatever the training
    rewards are), None when the task defines none; `faults` counts the rewards' failures
    (fastgrpo.rewards.faults.RewardFaults)."""

    def __init__(self, fns: Dict[str, Callable], gate=None, process=None, verifier=None):
        from fastgrpo.rewards.faults import RewardFaults

        self.fns = fns
        self.gate = gate
        self.process = process
        self.verifier = verifier
        self.faults = RewardFaults()

    def __getitem__(self, name: str) -> Callable:
        if name == "accuracy" and name not in self.fns and self.verifier is not None:
            return self.verifier  # the task's accuracy for the callers that measure (fusion's sweep), not trained on
        return self.fns[name]

    def __contains__(self, name: str) -> bool:
        return name in self.fns

    def keys(self):
        return self.fns.keys()

    def get(self, name, default=None):
        return self.fns.get(name, default)

    def metrics(self) -> Dict[str, float]:
        """The counters some rewards keep about their last call (judge asks, unparsable scores)."""
        out = {k: v for fn in self.fns.values() if hasattr(fn, "metrics") for k, v in fn.metrics().items()}
        if self.process is not None and self.process not in self.fns.values():  # dense step advantages alone
            out.update(self.process.metrics())
        out.update(self.faults.metrics())
        return out

    def state_dict(self) -> dict:
        out = {"kimi_gate": self.gate.state_dict()} if self.gate is not None else {}
        out["faults"] = self.faults.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        if self.gate is not None and state.get("kimi_gate") is not None:
            self.gate.load_state_dict(state["kimi_gate"])
        if state.get("faults") is not None:
            self.faults.load_state_dict(state["faults"])


def build_rewards(rcfg, task, max_new_tokens: int, base_dir=None) -> Rewards:
    """The callables of `rcfg.functions` (a `RewardsConfig`) for `task`. Unknown names and user
    functions that fail to import raise ValueError naming the entry (call it before any model
    or engine starts). `base_dir`: the config file's folder, where a user function's module or
    file is looked up before the working directory (rewards.inputs.import_reward)."""
    from fastgrpo.rewards.code import code_reward
    from fastgrpo.rewards.format import format_reward
    from fastgrpo.rewards.language import language_reward
    from fastgrpo.rewards.length import KimiLengthGate, kimi_length_reward, overlong_penalty

    from fastgrpo.rewards.process import build_process

    from fastgrpo.rewards.worker import TimedReward

    task_fns = dict(task.reward_fns()) if hasattr(task, "reward_fns") else {}
    task_name = getattr(task, "name", type(task).__name__)
    fns: Dict[str, Callable] = {}
    gate = None
    timeout = float(getattr(rcfg, "timeout", 0.0) or 0.0)  # rewards.timeout: user and model rewards
    process = build_process(rcfg.process, timeout, base_dir)  # its scorer imported here: a bad path fails at load
    timed = (lambda fn, name: TimedReward(fn, name, timeout)) if timeout > 0 else (lambda fn, name: fn)  # noqa: E731

    def accuracy_of(inputs: RewardInputs):
        if "accuracy" in inputs.scores:
            return inputs.scores["accuracy"]
        if "accuracy" not in task_fns:
            raise ValueError(f"task {task_name} defines no accuracy reward")
        return list(call_reward(task_fns["accuracy"], inputs))

    models = getattr(rcfg, "models", None) or {}
    for i, name in enumerate(rcfg.functions):
        why = check_reward_name(name, tuple(task_fns) + tuple(models))
        if why is not None:
            raise ValueError(f"config rewards.functions[{i}]={name!r}: unknown reward; expected {why}")
        if name in models and name not in task_fns:  # a reward model / judge (fastgrpo.rewards.judge), loaded once, here at load time
            from fastgrpo.rewards.judge import load_model_reward

            fns[name] = timed(load_model_reward(name, models[name]), name)
        elif name == "accuracy" and getattr(rcfg, "accuracy_judge", ""):
            from fastgrpo.rewards.judge import JudgedAccuracy, load_model_reward

            if not hasattr(task, "extract"):
                raise ValueError(f"config rewards.accuracy_judge={rcfg.accuracy_judge!r}: task {task_name}'s accuracy is "
                                 "not the symbolic math verifier (the judge backs a math task's accuracy)")
            fns[name] = timed(JudgedAccuracy(load_model_reward(rcfg.accuracy_judge, models[rcfg.accuracy_judge]),
                                             task.extract), name)
        elif ":" in name:
            fns[name] = user_reward(import_reward(name, base_dir=base_dir), name, timeout)
        elif name in task_fns:  # the task's own definition wins (e.g. its accuracy, its format)
            fn = task_fns[name]
            fns[name] = fn if getattr(fn, "takes_inputs", False) else inputs_reward(
                lambda inputs, fn=fn: fn(inputs.completions, inputs.answers))
            if name in models:  # a reward model the task routes (rm_stage): under rewards.timeout as well
                fns[name] = timed(fns[name], name)
        elif name == "accuracy":
            raise ValueError(f"config rewards.functions[{i}]='accuracy': task {task_name} defines no accuracy reward")
        elif name == "env":  # the environment's own reward (rollout.env); 0 for an episode it did not score
            fns[name] = inputs_reward(lambda inputs: [float(getattr(e, "env_reward", None) or 0.0)
                                                      for e in (inputs.episodes or [None] * len(inputs))])
        elif name == "process":
            if process is None:
                raise ValueError(f"config rewards.functions[{i}]='process': expected a step scorer in rewards.process.scorer")
            process.outcome = True  # a completion without steps scores rewards.error_score: reported
            fns[name] = process
        elif name == "format":
            think, answer, strict = rcfg.format_think_tag, rcfg.format_answer_tag, rcfg.format_strict
            fns[name] = inputs_reward(lambda inputs: format_reward(inputs.completions, think_tag=think,
                                                                   answer_tag=answer, strict=strict))
        elif name == "language":
            lang, think = rcfg.language, rcfg.format_think_tag
            language_reward([], language=lang)  # an unknown language fails here, at load
            fns[name] = inputs_reward(lambda inputs: language_reward(inputs.completions, language=lang,
                                                                     think_tag=think))
        elif name == "overlong":
            cache = rcfg.overlong_cache or max(1, max_new_tokens // 4)
            if cache > max_new_tokens:
                raise ValueError(f"config rewards.overlong_cache={cache}: expected at most rollout.max_new_tokens={max_new_tokens}")
            fns[name] = inputs_reward(lambda inputs: overlong_penalty(inputs.lengths, max_new_tokens, cache))
        elif name == "kimi_length":
            gate = KimiLengthGate(min_step=rcfg.kimi_min_step or None, min_accuracy=rcfg.kimi_min_accuracy)

            def kimi(inputs: RewardInputs, gate=gate):
                correct = [s is not None and s >= 1.0 for s in accuracy_of(inputs)]
                groups = [j // max(1, inputs.group_size) for j in range(len(inputs))]
                return kimi_length_reward(inputs.lengths, correct, groups=groups, gate=gate, step=inputs.step)

            fns[name] = inputs_reward(kimi)
        elif name == "code":
            timeout = rcfg.code_timeout

            def code(inputs: RewardInputs):
                tests = inputs.tests
                if any(t is None for t in tests):
                    raise ValueError("the code reward needs a `tests` field on every problem (data.columns.tests)")
                return code_reward(inputs.completions, tests, timeout)

            fns[name] = inputs_reward(code)
    verifier = fns.get("accuracy")
    if verifier is None and "accuracy" in task_fns:  # held-out accuracy is the task's, whatever the run trains on
        acc = task_fns["accuracy"]
        verifier = acc if getattr(acc, "takes_inputs", False) else inputs_reward(
            lambda inputs, fn=acc: fn(inputs.completions, inputs.answers))
    return Rewards(fns, gate, process, verifier)
