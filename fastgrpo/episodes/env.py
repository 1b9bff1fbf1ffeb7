"""User environments: one instance per episode, each in its own process.

The protocol (`rollout.env: module:Class`, or `path/to/file.py:Class`):

    class MyEnv:
        def reset(self, row: dict) -> str | None: ...   # the task's data row; optional first observation
        def step(self, text: str) -> tuple[str, float | None, bool]: ...   # (observation, reward, done)

`step` gets the text of each model turn (parsed, never re-encoded: the sampled ids stay the
trained ids). This is the gym reset / step loop with text in and text out, as in verifiers'
`MultiTurnEnv` (`env_response` / `is_completed`), reduced to two methods.

`load_env` validates at load time (the class exists, is constructible without arguments, has
callable `reset` and `step`), with one-line errors naming `rollout.env`. `EnvProcess` runs one
instance out of process: a child started through the multiprocessing fork server that calls
`setsid()` (its own process group), constructs the class and serves reset / step over a pipe,
each call under a wall-clock timeout. On a timeout or a crash the whole group is SIGKILLed and
the call raises `EnvFailure(status="timeout" | "error", message)`; an exception inside reset /
step raises `EnvFailure("error", ...)` and leaves the instance running. `close()` kills it.

Two other shapes are accepted and adapted in the child (env_adapters.py):
- TRL's `environment_factory` (read in trl 1.16.0, trl/trainer/grpo_trainer.py: the factory is a
  zero-argument callable; `reset(**row)` returns None or a string appended to the last user
  message; every public method of the class other than `reset` / `get_reward` is a tool; an
  optional `get_reward()` returns the episode's float reward). A class of that shape, or a
  zero-argument factory returning one, is adapted: its methods become tools (`EnvProcess.tools`,
  `EnvProcess.call_tool`), and `step(text)` runs the turn's `<tool_call>`s on them, the episode
  ending at the first turn without a call, scored by `get_reward()` when defined.
- verifiers' `MultiTurnEnv` (read in verifiers 0.1.10, verifiers/envs/multiturn_env.py, and its
  older releases: `env_response(messages, state)` returning messages or (messages, state),
  `is_completed(messages, state)` or `is_completed(state)`, sync or async); only when verifiers
  imports, otherwise load_env says to install it.
Departure from both: the instance lives in its own process with a timeout, not in the trainer.
"""
from __future__ import annotations

import inspect
import os
import types
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from fastgrpo.episodes.env_adapters import trl_tool_methods
from fastgrpo.episodes.toolproc import become_session_leader, kill_group, wait_group_gone, worker_context
from fastgrpo.episodes.tools import SpecError, reimport, resolve_spec, tool_schema

FIELD = "rollout.env"
# tool schemas of factory specs (known only once a process has built one instance): later
# processes of the same spec get them instead of importing transformers to rebuild them
_FACTORY_TOOLS: dict = {}


class EnvFailure(RuntimeError):
    """An environment call timed out or its process died / raised; the episode cannot go on."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status  # "timeout" | "error"
        self.message = message  # one line: the spec, the call and what happened


@dataclass(frozen=True)
class EnvSpec:
    spec: str  # as written in the config
    kind: str  # "native" (reset / step), "trl" (reset + tool methods), "verifiers", "factory" (decided in the child)
    origin: str  # reloadable form of the spec in the environment process
    paths: Tuple[str, ...] = ()  # folders put first on sys.path while importing it there
    tools: Tuple[dict, ...] = field(default=(), compare=False)  # tool schemas (TRL shape), known at load


def _err(spec: str, what: str) -> SpecError:
    return SpecError(f"config {FIELD}: {spec!r}: {what}")


def _required_args(fn) -> list:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def classify(obj: Any, spec: str) -> Tuple[str, Tuple[dict, ...]]:
    """(kind, tool schemas) of an environment class or instance; SpecError when it fits no shape."""
    cls = obj if inspect.isclass(obj) else type(obj)
    has = {n: callable(getattr(cls, n, None)) for n in ("reset", "step", "env_response", "is_completed")}
    if has["reset"] and has["step"]:
        return "native", ()
    if has["env_response"] and has["is_completed"]:
        try:
            import verifiers  # noqa: F401
        except ImportError:
            raise _err(spec, "is a verifiers MultiTurnEnv (env_response / is_completed), but verifiers is not "
                             "installed; pip install verifiers, or give it reset(row) and step(text)") from None
        return "verifiers", ()
    if not has["reset"]:
        missing = "reset(self, row) and step(self, text)" if not has["step"] else "reset(self, row)"
        raise _err(spec, f"has no callable {missing}; an environment defines reset(self, row) -> str | None and "
                         "step(self, text) -> (observation, reward, done)")
    methods = trl_tool_methods(cls)
    if not methods:
        raise _err(spec, "has reset() but no step(self, text) -> (observation, reward, done), and no public tool "
                         "methods (TRL's environment_factory shape); define one of the two")
    schemas = []
    for name, fn in methods.items():
        try:  # bound to a stand-in: the schema drops `self` and never calls the method
            schemas.append(tool_schema(types.MethodType(fn, object()), spec=f"{spec}.{name}", field_name=FIELD))
        except ValueError as e:
            raise _err(spec, f"tool method {name}(): " + str(e).split(": ", 2)[-1]) from None
    return "trl", tuple(schemas)


def load_env(spec: str, base_dir: Optional[str] = None) -> EnvSpec:
    """Resolve and validate a `rollout.env` spec (ValueError naming the field on any problem)."""
    obj, origin, paths = resolve_spec(spec, base_dir, FIELD, "class")
    spec = spec.strip()
    if inspect.isclass(obj):
        req = _required_args(obj)
        if req:
            raise _err(spec, f"the class needs arguments ({', '.join(req)}) to be constructed; an environment is "
                             "built without arguments, once per episode (the data row goes to reset(row))")
        kind, schemas = classify(obj, spec)
        return EnvSpec(spec, kind, origin, paths, schemas)
    if callable(obj) and not isinstance(obj, type):
        req = _required_args(obj)
        if req:
            raise _err(spec, f"is a function with required parameters ({', '.join(req)}); expected a class, or a "
                             "zero-argument factory returning an environment (TRL's environment_factory)")
        return EnvSpec(spec, "factory", origin, paths)
    raise _err(spec, f"is a {type(obj).__name__}, not a class; expected 'module:Class' with reset(self, row) and "
                     "step(self, text)")


# -- the environment process -------------------------------------------------------------------
def _env_main(conn, origin: str, paths: tuple, kind: str, spec: str, max_chars: int, schemas: list) -> None:
    become_session_leader(os.getppid())
    from fastgrpo.episodes import env_adapters as A

    try:
        obj = reimport(origin, paths)
        inst = obj()
        if kind == "factory" and not schemas:
            kind, schemas = classify(inst, spec)
        elif kind == "factory":  # the shape seen in an earlier process of this spec
            kind = "trl"
        inst = A.wrap(inst, kind, max_chars, schemas)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", kind, [t for t in inst.tool_schemas()]))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        op, args = msg[0], msg[1:]
        if op == "close":
            return
        try:
            out = getattr(inst, op)(*args)
            reply = ("ok", A.check_reply(op, out))
        except BaseException as e:  # the episode fails; the instance keeps serving
            reply = ("error", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        conn.send(reply)


class EnvProcess:
    """One environment instance in its own process (and process group).

    Args:
        spec: a `rollout.env` spec or a loaded EnvSpec.
        base_dir: the config file's folder (where relative specs are looked up).
        timeout: wall-clock seconds per reset / step / call_tool.
        start_timeout: seconds for the process to start and construct the instance.
        max_output_chars: cap on a TRL-shape tool method's result text.
    """

    def __init__(self, spec, base_dir: Optional[str] = None, *, timeout: float = 30.0, start_timeout: float = 60.0,
                 max_output_chars: int = 4000, context: str = "forkserver"):
        self.spec = spec if isinstance(spec, EnvSpec) else load_env(spec, base_dir)
        for key, val in (("timeout", timeout), ("start_timeout", start_timeout)):
            if isinstance(val, bool) or not isinstance(val, (int, float)) or val <= 0:
                raise ValueError(f"{key}={val!r}: expected a positive number of seconds")
        self.timeout = float(timeout)
        ctx = worker_context(context)
        schemas = list(self.spec.tools) or _FACTORY_TOOLS.get(self.spec.origin, [])
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_env_main, name="fastgrpo-env", daemon=True,
                                 args=(child, self.spec.origin, tuple(self.spec.paths), self.spec.kind,
                                       self.spec.spec, int(max_output_chars), schemas))
        self._proc.start()
        child.close()
        self.pid: int = self._proc.pid  # also the id of its process group (the child calls setsid)
        reply = self._wait("start", float(start_timeout))
        if reply[0] != "ready":
            self.close()
            raise EnvFailure("error", f"{FIELD} {self.spec.spec!r}: constructing the environment raised {reply[1]}")
        self.kind: str = reply[1]  # the shape the child adapted ("native", "trl", "verifiers")
        self.tools: list = list(reply[2])  # tool schemas the model may call (TRL shape), else []
        if self.spec.kind == "factory" and self.kind == "trl":
            _FACTORY_TOOLS.setdefault(self.spec.origin, self.tools)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def reset(self, row: dict) -> Optional[str]:
        """Start an episode on `row` (the task's data row); the optional first observation."""
        if not isinstance(row, dict):
            raise TypeError(f"reset(row): expected the data row as a dict, got {type(row).__name__}")
        return self._request("reset", row)

    def step(self, text: str) -> Tuple[str, Optional[float], bool]:
        """Send one model turn's text; (observation, reward, done)."""
        return tuple(self._request("step", text))

    def call_tool(self, name: str, arguments: dict) -> Tuple[str, str]:
        """Run one of the instance's tool methods (TRL shape); (status "ok" | "error", text)."""
        return tuple(self._request("call_tool", name, arguments))

    def close(self) -> None:
        """Kill the process and its group. Idempotent."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        try:
            self._conn.send(("close",))
        except Exception:
            pass
        kill_group(self.pid)
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
        wait_group_gone(self.pid)
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- internals --------------------------------------------------------------------------
    def _wait(self, op: str, timeout: float):
        what = f"{FIELD} {self.spec.spec!r}: {op}()"
        try:
            if not self._conn.poll(timeout):
                self.close()
                raise EnvFailure("timeout", f"{what} did not return within {timeout:g} s; the environment was stopped")
            return self._conn.recv()
        except (EOFError, OSError):
            proc = self._proc
            code = None
            if proc is not None:
                proc.join(1.0)
                code = proc.exitcode
            self.close()
            how = (f"killed by signal {-code}" if code < 0 else f"exit status {code}") if isinstance(code, int) else "?"
            raise EnvFailure("error", f"{what}: the environment process died ({how})") from None

    def _request(self, op: str, *args):
        if self._proc is None:
            raise EnvFailure("error", f"{FIELD} {self.spec.spec!r}: {op}(): the environment process is closed")
        try:
            self._conn.send((op,) + args)
        except (OSError, ValueError) as e:
            self.close()
            raise EnvFailure("error", f"{FIELD} {self.spec.spec!r}: {op}(): cannot reach the environment process "
                                      f"({type(e).__name__})") from None
        reply = self._wait(op, self.timeout)
        if reply[0] == "error":
            raise EnvFailure("error", f"{FIELD} {self.spec.spec!r}: {op}() raised {reply[1]}")
        return reply[1]
