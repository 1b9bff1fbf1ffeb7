"""Adapters from other environment shapes to reset(row) / step(text), run inside the env process.

- `TRLEnvAdapter`: TRL's `environment_factory` objects (trl 1.16.0, trl/trainer/grpo_trainer.py,
  `GRPOTrainer.__init__` and `_tool_call_loop`): `reset(**row)` returns None or a string, the
  public methods are tools (schemas from their hints and docstrings, as TRL builds them with
  get_json_schema), `get_reward()` optionally scores the episode. TRL runs the chat template's
  tool-call parser and calls the methods in the trainer process; here `step(text)` parses the
  turn's `<tool_call>`s (calls.py), calls the methods in the env process and returns their
  results as `<tool_response>` blocks; a turn without a call ends the episode. Results and
  errors are text, never an exception (TRL sends `{"error": str(e)}` back the same way).
- `VerifiersEnvAdapter`: verifiers' `MultiTurnEnv` (verifiers/envs/multiturn_env.py in 0.1.10
  and older releases): keeps the message list and the `state` dict, asks `is_completed` after
  each model turn and `env_response` for the observation. Its API changed across releases
  (sync → async, `is_completed(messages, state)` → `is_completed(state)`, `env_response`
  returning `(messages, state)` → messages); the adapter accepts each form. Rubric scoring is
  not adapted: rewards stay with fastgrpo's reward functions.
"""
from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any, Optional, Sequence

from fastgrpo.episodes.calls import TOOL_RESPONSE_END, TOOL_RESPONSE_START, ToolCall, parse_tool_calls_ordered
from fastgrpo.episodes.tools import Tool, check_arguments, result_text, tool_schema


def trl_tool_methods(cls) -> dict:
    """{name: function} of the public methods TRL exposes as tools (not reset / get_reward),
    listed on the class as TRL does (getmembers on an instance would evaluate properties)."""
    return {n: f for n, f in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not n.startswith("_") and n not in ("reset", "get_reward")}


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + f"\n...[{len(text) - max_chars} more characters cut]"


class NativeEnv:
    """A reset / step environment as it is (no tools of its own)."""

    def __init__(self, env: Any, max_chars: int, schemas: Sequence[dict] = ()):
        self.env = env

    def tool_schemas(self) -> list:
        return []

    def reset(self, row: dict) -> Optional[str]:
        return self.env.reset(row)

    def step(self, text: str):
        return self.env.step(text)

    def call_tool(self, name: str, arguments: dict):
        return "error", f"Error: this environment has no tools (asked for '{name}')"


class TRLEnvAdapter(NativeEnv):
    """A TRL environment_factory object: reset(**row), public methods as tools, get_reward()."""

    def __init__(self, env: Any, max_chars: int, schemas: Sequence[dict] = ()):

        super().__init__(env, max_chars)
        self.max_chars = max_chars
        # schemas computed in the trainer come along: building them here would import
        # transformers (~1 s) in every episode's process
        known = {s["function"]["name"]: s["function"] for s in schemas}
        self.tools = {}
        for name in trl_tool_methods(type(env)):
            method = getattr(env, name)
            fn = known.get(name) or tool_schema(method, spec=f"{type(env).__name__}.{name}",
                                                field_name="rollout.env")["function"]
            self.tools[name] = Tool(name, fn.get("description", ""), fn["parameters"], name, method)

    def tool_schemas(self) -> list:
        return [t.schema for t in self.tools.values()]

    def reset(self, row: dict) -> Optional[str]:
        return self.env.reset(**row)

    def call_tool(self, name: str, arguments: dict):
        tool = self.tools.get(name)
        if tool is None:
            return "error", f"Error: unknown tool '{name}'; available tools: {', '.join(self.tools) or 'none'}"
        args, problem = check_arguments(tool, arguments)
        if problem:
            return "error", "Error: " + problem
        try:
            return "ok", _cut(result_text(tool.fn(**args)), self.max_chars)
        except Exception as e:
            return "error", _cut(f"Error: {type(e).__name__}: {e}", self.max_chars)

    def step(self, text: str):
        calls = parse_tool_calls_ordered(text)
        if not calls:
            get_reward = getattr(self.env, "get_reward", None)
            return "", (float(get_reward()) if callable(get_reward) else None), True
        blocks = []
        for c in calls:
            out = self.call_tool(c.name, c.arguments)[1] if isinstance(c, ToolCall) else \
                f"Error: could not parse the tool call: {c}"
            blocks.append(f"{TOOL_RESPONSE_START}\n{out}\n{TOOL_RESPONSE_END}")
        return "\n".join(blocks), None, False


def _run(value):
    """The value of a maybe-coroutine (verifiers made its hooks async in 0.1.3)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _positional(fn) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
        return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    except (TypeError, ValueError):
        return 2


class VerifiersEnvAdapter(NativeEnv):
    """A verifiers MultiTurnEnv: messages and state kept here, is_completed then env_response."""

    def reset(self, row: dict) -> Optional[str]:
        prompt = row.get("prompt", "")
        self.messages = ([dict(m) for m in prompt] if isinstance(prompt, list)
                         else [{"role": "user", "content": str(prompt)}])
        self.state = {"prompt": list(self.messages), "completion": [], "answer": row.get("answer", ""),
                      "task": row.get("task", "default"), "info": row.get("info", {}), "responses": [],
                      "turn": 0, "trajectory": []}
        setup = getattr(self.env, "setup_state", None)
        if callable(setup):
            out = _run(setup(self.state))
            if isinstance(out, dict):
                self.state = out
        return None

    def step(self, text: str):
        reply = {"role": "assistant", "content": text}
        self.state["trajectory"].append({"prompt": list(self.messages), "completion": [reply]})
        self.messages.append(reply)
        self.state["responses"].append(text)
        self.state["completion"].append(reply)
        self.state["turn"] += 1
        done_fn = self.env.is_completed
        done = _run(done_fn(self.messages, self.state) if _positional(done_fn) >= 2 else done_fn(self.state))
        if done:
            return "", None, True
        out = _run(self.env.env_response(self.messages, self.state))
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out, self.state = out
        msgs = [out] if isinstance(out, dict) else list(out or [])
        self.messages.extend(msgs)
        self.state["completion"].extend(msgs)
        obs = "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in msgs)
        return obs, None, False


def wrap(inst: Any, kind: str, max_chars: int, schemas: Sequence[dict] = ()) -> NativeEnv:
    return {"native": NativeEnv, "trl": TRLEnvAdapter, "verifiers": VerifiersEnvAdapter}[kind](inst, max_chars, schemas)


def check_reply(op: str, out: Any) -> Any:
    """The reply of reset / step / call_tool in its protocol shape (TypeError naming what is
    wrong, raised in the env process, when the user's method returns something else)."""
    if op == "reset":
        if out is not None and not isinstance(out, str):
            raise TypeError(f"reset() returned {type(out).__name__}; expected a str (the first observation) or None")
        return out
    if op == "step":
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError(f"step() returned {type(out).__name__}; expected a tuple (observation: str, reward: "
                            "float | None, done: bool)")
        obs, reward, done = (x.item() if hasattr(x, "item") and getattr(x, "shape", None) == () else x for x in out)
        if obs is None:
            obs = ""
        if not isinstance(obs, str):
            raise TypeError(f"step() observation is {type(obs).__name__}; expected a str")
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
                raise TypeError(f"step() reward is {reward!r}; expected a finite float or None")
            reward = float(reward)
        if not isinstance(done, bool):
            raise TypeError(f"step() done is {type(done).__name__}; expected a bool")
        return obs, reward, done
    return out
