"""The one input type every reward of the trainer's scoring path
(`fastgrpo.rewards.combine.score_groups`) receives, and the reward-function protocol.

A reward is a callable `fn(inputs: RewardInputs) -> list[float | None]` marked with
`@inputs_reward` (so the scoring path knows to pass the whole `RewardInputs`); a plain
two-argument callable `fn(completions, answers)` (the older task signature) is still accepted.
A user's function is imported from `module:function` (`import_reward`) and wrapped to that
protocol (`user_reward`), which hands it what TRL's GRPOTrainer hands a reward function
(`trl_kwargs`: completions and prompts in the dataset's own form, message lists on chat data, and
every dataset column) and, with `rewards.timeout`, runs it in a worker process
(fastgrpo/rewards/worker.py). The rewards a config names are built in fastgrpo/rewards/registry.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence


@dataclass
class RewardInputs:
    """One scoring call's inputs, completion-major (B prompts × G completions, group after group)."""

    completions: List[str]  # decoded completion texts
    problems: List[Any]  # the task's Problem of each completion (repeated G times)
    lengths: List[int] = field(default_factory=list)  # completion token counts
    truncated: List[bool] = field(default_factory=list)  # True where generation hit the length cap
    completion_ids: List[List[int]] = field(default_factory=list)  # completion token ids
    group_size: int = 1  # G (completions i·G … i·G+G−1 answer the same prompt)
    scores: Dict[str, List[Optional[float]]] = field(default_factory=dict)  # rewards scored earlier in this call
    step: int = 0  # the training step (for rewards that switch on after a number of steps)
    episodes: List[Any] = field(default_factory=list)  # multi-turn: each completion's episode ledger (fastgrpo.episodes.ledger), else empty

    @property
    def answers(self) -> List[str]:
        return [getattr(p, "answer", "") for p in self.problems]

    @property
    def prompts(self) -> List[str]:
        return [getattr(p, "prompt", "") for p in self.problems]

    @property
    def tests(self) -> List[Optional[str]]:
        return [getattr(p, "tests", None) for p in self.problems]

    def __len__(self) -> int:
        return len(self.completions)

    def slice(self, start: int, stop: int) -> "RewardInputs":
        """The completions [start, stop) (whole groups when start, stop are multiples of G)."""
        cut = lambda xs: list(xs[start:stop]) if xs else []  # noqa: E731
        return RewardInputs(cut(self.completions), cut(self.problems), cut(self.lengths), cut(self.truncated),
                            cut(self.completion_ids), self.group_size,
                            {k: list(v[start:stop]) for k, v in self.scores.items()}, self.step)


def inputs_reward(fn: Callable) -> Callable:
    """Mark `fn(inputs: RewardInputs) -> scores` as taking the whole RewardInputs."""
    fn.takes_inputs = True
    return fn


def call_reward(fn: Callable, inputs: RewardInputs) -> Sequence[Optional[float]]:
    """Call a reward in either signature."""
    if getattr(fn, "takes_inputs", False):
        return fn(inputs)
    return fn(inputs.completions, inputs.answers)

def search_dirs(base_dir: Optional[str] = None) -> List[str]:
    """Where a user function's module or file is looked up: the config file's folder (`base_dir`),
    then the working directory; absolute, without repeats."""
    import os

    return list(dict.fromkeys([os.path.abspath(d) for d in (base_dir, os.getcwd()) if d]))


def _import_module(name: str, dirs: Sequence[str]):
    """`import name` from sys.path, else from the first of `dirs` that holds it (that folder is
    then kept on sys.path: the user-reward worker imports with this process's sys.path, and the
    module may import its siblings)."""
    import importlib
    import os
    import sys

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = name.split(".")[0]
        if e.name != top:  # the module exists; something it imports does not
            raise
        for d in dirs:
            if os.path.isfile(os.path.join(d, top + ".py")) or os.path.isdir(os.path.join(d, top)):
                if d not in sys.path:
                    sys.path.insert(0, d)
                importlib.invalidate_caches()
                return importlib.import_module(name)
        raise


def import_reward(path: str, field: str = "rewards.functions", base_dir: Optional[str] = None) -> Callable:
    """The user function at `module:function` (a dotted module) or `file.py:function`, looked up
    on sys.path, then in the config file's folder `base_dir` and the working directory
    (`search_dirs`); a failure raises ValueError naming the config `field` and both forms."""
    import importlib
    import importlib.util
    import os

    mod_name, fn_name = path.rsplit(":", 1)
    dirs = search_dirs(base_dir)
    try:
        if mod_name.endswith(".py"):
            cands = [mod_name] if os.path.isabs(mod_name) else [os.path.join(d, mod_name) for d in dirs]
            file = next((os.path.abspath(c) for c in cands if os.path.isfile(c)), None)
            if file is None:
                raise ImportError(f"no file {mod_name}")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(file))[0], file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = _import_module(mod_name, dirs)
    except Exception as e:  # noqa: BLE001 — any failure of the user's import is reported with its path
        where = " and ".join(dirs)
        stem = mod_name[:-3] if mod_name.endswith(".py") else mod_name.replace(".", "/")
        raise ValueError(f"config {field}: {path!r}: cannot import {mod_name!r} ({type(e).__name__}: {e}); looked on "
                         f"sys.path and in {where} (the config file's folder, then the working directory): write "
                         f"'{os.path.basename(stem)}:{fn_name}' with {stem}.py in one of those folders, or "
                         f"'path/to/{os.path.basename(stem)}.py:{fn_name}'") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"config {field}: {path!r}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def chat_prompt(problem) -> Optional[List[dict]]:
    """The problem's prompt as the dataset holds it when that is a conversation (TRL's
    `is_conversational`): its `prompt` or `messages` column, else the one column of the row that
    is a list of {role, content} messages (a mapped `data.columns.prompt` / `messages`), without
    a final assistant turn (the row's reference reply, as the task reads it); None when the row
    has no conversation (a plain-text prompt)."""
    row = getattr(problem, "row", None) or {}
    found = [row[c] for c in ("prompt", "messages") if _is_messages(row.get(c))]
    if not found:
        found = [v for v in row.values() if _is_messages(v)]
        if len(found) != 1:
            return None
    turns = [dict(m) for m in found[0]]
    return turns[:-1] if len(turns) > 1 and turns[-1].get("role") == "assistant" else turns


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


# TRL hands every dataset column but these to a reward function (GRPOTrainer._calculate_rewards)
_NOT_KWARGS = ("prompt", "completion", "completion_ids")


def trl_kwargs(inputs: RewardInputs) -> Dict[str, Any]:
    """What TRL's GRPOTrainer passes a reward function, for these inputs: `prompts`, `completions`,
    `completion_ids` and every dataset column but prompt / completion / completion_ids as a list
    (one entry per completion). On conversational data (the first problem's row holds a message
    list, TRL's test on the first prompt) prompts are the message lists and each completion is
    `[{"role": "assistant", "content": text}]`, as TRL hands them; otherwise both are strings.
    fastgrpo adds `answers` / `answer` (the task's reference answers) and `tests`."""
    chat = bool(inputs.problems) and chat_prompt(inputs.problems[0]) is not None
    if chat:
        prompts: List[Any] = [chat_prompt(p) or [{"role": "user", "content": getattr(p, "prompt", "")}]
                              for p in inputs.problems]
        completions: List[Any] = [[{"role": "assistant", "content": c}] for c in inputs.completions]
    else:
        prompts, completions = inputs.prompts, list(inputs.completions)
    rows = [getattr(p, "row", None) or {} for p in inputs.problems]
    kw: Dict[str, Any] = {}
    for col in sorted({k for r in rows for k in r} - set(_NOT_KWARGS)):
        kw[col] = [r.get(col) for r in rows]
    kw.update(prompts=prompts, completions=completions, completion_ids=inputs.completion_ids,
              answers=inputs.answers, answer=inputs.answers, tests=inputs.tests)
    return kw


def user_reward(fn: Callable, name: str = "", timeout: float = 0.0) -> Callable:
    """Adapt a user function to RewardInputs. TRL's reward-function signature is accepted:
    `fn(prompts, completions, completion_ids, **columns)` with what `trl_kwargs` builds
    (completions as message lists on chat data, as TRL hands them). A function whose required
    parameters are all among those names is called by keyword (only the ones it accepts, unless
    it takes **kwargs); one with two positional parameters none of whose names are known gets
    (completions, answers), fastgrpo's older signature, with plain texts; any other raises a
    TypeError naming the parameters nothing provides (e.g. TRL's `trainer_state`, not passed).

    `timeout` > 0 with a `module:function` / `file.py:function` name: each call runs in the
    user-reward worker (fastgrpo.rewards.worker) and raises RewardTimeout past `timeout`
    seconds; 0: called in this process."""
    import inspect

    from fastgrpo.rewards.worker import WorkerFunction, call_here

    label = name or getattr(fn, "__name__", "fn")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    params = dict(sig.parameters) if sig is not None else {}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    required = [n for n, p in params.items() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    run = WorkerFunction(name, fn, timeout, label) if timeout and ":" in name else None

    @inputs_reward
    def call(inputs: RewardInputs):
        kw = trl_kwargs(inputs)
        if sig is None or all(n in kw for n in required):
            args, kwargs = (), (kw if var_kw or sig is None else {k: v for k, v in kw.items() if k in params})
        elif not any(n in kw for n in required) and (len(positional) >= 2 or any(
                p.kind is p.VAR_POSITIONAL for p in params.values())):
            args, kwargs = (inputs.completions, inputs.answers), {}
        else:
            missing = [n for n in required if n not in kw]
            raise TypeError(f"cannot call {label}{sig}: its parameters {missing} are neither TRL's (prompts, "
                            f"completions, completion_ids), fastgrpo's (answers, tests) nor dataset columns "
                            f"({sorted(k for k in kw if k not in ('prompts', 'completions', 'completion_ids'))})")
        if run is not None:
            return run(*args, **kwargs)
        return call_here(label, fn, *args, **kwargs)

    call.__name__ = f"user_reward[{label}]"
    return call
