"""User rewards in a worker process with a timeout, model rewards under a timeout, and what a
reward prints routed to the run log.

`rewards.timeout` (seconds per call; 0 = off) bounds every user reward (`module:function`,
`file.py:function`, a process-reward scorer) and every model reward. Why a process for user
code: a Python function that never returns cannot be stopped from inside its own process (a
thread cannot be killed, `signal.alarm` works only in the main thread and not inside a long C
call — the reason the verifiers already run in `RewardPool` workers, fastgrpo/rewards/sandbox/pool.py).
So a user reward runs in a `RewardPool` of its own (one worker: the trainer calls rewards one
after the other; no memory limit or network namespace, which a user's reward — an HTTP judge,
a tokenizer — may need), whose dispatcher SIGKILLs a worker that overruns and starts a new one;
the call raises `RewardTimeout`, the trainer scores its completions `rewards.error_score` and
counts them. The worker imports the function itself (`module:function` with the trainer's
`sys.path`, `file.py:function` by absolute path), once per worker.

Model rewards (fastgrpo/rewards/judge.py) hold a model in the trainer process, which a worker
would have to load again; they run in a thread instead, and a call that overruns raises
`RewardTimeout` while the thread finishes in the background (a running forward cannot be
interrupted); until it does, further calls of that reward time out at once rather than use the
model from two threads. Departure from "the hung worker replaced": for a model reward nothing is
replaced, the run goes on without its scores.

Output: the worker captures what the function prints (stdout, stderr, `logging` without a
handler) and the warnings it raises, and the trainer relays them to the logger
`fastgrpo.reward_output`, which `fastgrpo.logs.console.quiet_console` routes to
`<run>/log.txt` (each distinct warning once); without a quiet console (`--verbose`, library use)
printed text goes to stdout as before.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

OUTPUT_LOGGER = "fastgrpo.reward_output"

_POOL = None
_POOL_LOCK = threading.Lock()
_SEEN_WARNINGS: set = set()


class RewardTimeout(Exception):
    """A reward call that ran past `rewards.timeout`."""

    def __init__(self, name: str, seconds: float, detail: str = ""):
        self.name, self.seconds = name, seconds
        super().__init__(f"timed out after {seconds:g} s (rewards.timeout){detail}")


class RewardError(Exception):
    """A user reward that raised in its worker; the message is the original `Type: text`."""


def describe(e: BaseException) -> str:
    """One line for a reward failure: `Type: message` (the original type for a worker's error)."""
    if isinstance(e, (RewardError, RewardTimeout)):
        return str(e)
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def user_pool():
    """The process-wide pool of user rewards (created on first use, closed at exit)."""
    from fastgrpo.rewards.sandbox.pool import DEFAULT_PRELOAD, RewardPool

    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._closed or _POOL._broken or _POOL._pid != os.getpid():
            # the verifiers' preload: whichever pool starts the process-wide fork server first, both
            # fork warm workers (and a user reward calling Math-Verify, as TRL's accuracy_reward does)
            _POOL = RewardPool(num_workers=1, memory_limit_mb=None, isolate_network=False, preload=DEFAULT_PRELOAD)
        return _POOL


# ----------------------------------------------------------------------------- worker side
_LOADED: Dict[tuple, Callable] = {}


def _load(spec: str, file: Optional[str], mtime: float, path: Sequence[str]) -> Callable:
    key = (spec, file, mtime)
    fn = _LOADED.get(key)
    if fn is None:
        import importlib
        import importlib.util

        for p in reversed(list(path)):
            if p not in sys.path:
                sys.path.insert(0, p)
        mod_name, fn_name = spec.rsplit(":", 1)
        if mod_name.endswith(".py"):
            name = os.path.splitext(os.path.basename(file or mod_name))[0]
            s = importlib.util.spec_from_file_location(name, file or mod_name)
            module = importlib.util.module_from_spec(s)
            s.loader.exec_module(module)
        else:
            old = sys.modules.get(mod_name)
            if old is not None and file and os.path.abspath(getattr(old, "__file__", "") or "") != file:
                del sys.modules[mod_name]  # another module of the same name, seen by an earlier run
            module = importlib.import_module(mod_name)
            if file and getattr(module, "__file__", None) and os.path.getmtime(module.__file__) != mtime:
                module = importlib.reload(module)  # edited since this worker imported it
        fn = getattr(module, fn_name)
        _LOADED[key] = fn
    return fn


def _materialise(value):
    """What goes back through the pipe: a list where the function returned any sequence."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()  # numpy / torch arrays: plain Python numbers (a bool array stays bools)
    if isinstance(value, (list, tuple)) or value is None or isinstance(value, (str, bytes, int, float)):
        return value
    try:
        return list(value)
    except TypeError:
        return value


def run_in_worker(spec: str, file: Optional[str], mtime: float, path: Sequence[str], args: tuple, kwargs: dict,
                  each: bool) -> Tuple[str, Any, str, List[str]]:
    """Worker side: import the function (once), call it, capture its output.
    `each`: `args` is a list of argument tuples, one call each, and every call's
    (ok, value | error) is returned (the process-reward scorer: one call per completion).
    Returns (status 'ok' | 'error', value or 'Type: message', printed text, warnings)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn = _load(spec, file, mtime, path)
            if each:
                out = []
                for a in args:
                    try:
                        out.append((True, _materialise(fn(*a))))
                    except Exception as e:  # noqa: BLE001 — one item's failure, reported per item
                        out.append((False, describe(e)))
                status, value = "ok", out
            else:
                status, value = "ok", _materialise(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 — the user's error, sent back as text
            status, value = "error", describe(e)
    warns = [f"{os.path.basename(w.filename)}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught]
    return status, value, buf.getvalue(), warns


# ----------------------------------------------------------------------------- trainer side
def relay(name: str, text: str, warns: Sequence[str] = ()) -> None:
    """A reward's printed text and warnings: to the run log when a quiet console routes
    `fastgrpo.reward_output` there, else printed text to stdout and warnings to stderr; each
    distinct warning once per process."""
    lg = logging.getLogger(OUTPUT_LOGGER)
    routed = bool(lg.handlers)
    if text and text.strip():
        if routed:
            lg.info("reward %r printed:\n%s", name, text.rstrip("\n"))
        else:
            sys.stdout.write(text)
    for w in warns:
        if (name, w) in _SEEN_WARNINGS:
            continue
        _SEEN_WARNINGS.add((name, w))
        if routed:
            lg.warning("reward %r: %s", name, w)
        else:
            sys.stderr.write(f"reward {name!r}: {w}\n")


def source_of(spec: str, fn: Callable) -> Tuple[Optional[str], float]:
    """The absolute source file of a `module:function` / `file.py:function` and its mtime (the
    worker's cache key), or (None, 0) when it has none."""
    import inspect

    mod_name = spec.rsplit(":", 1)[0]
    try:
        # a file.py found in the config file's folder (rewards.inputs.import_reward): the function's own file
        file = (os.path.abspath(inspect.getsourcefile(fn) or mod_name) if mod_name.endswith(".py")
                else inspect.getsourcefile(sys.modules[fn.__module__]))
    except (TypeError, KeyError, AttributeError):
        file = os.path.abspath(mod_name) if mod_name.endswith(".py") else None
    try:
        return file, (os.path.getmtime(file) if file else 0.0)
    except OSError:
        return file, 0.0


class WorkerFunction:
    """A user function `spec` called in the user-reward pool with `timeout` seconds per call."""

    def __init__(self, spec: str, fn: Callable, timeout: float, name: str = ""):
        self.spec, self.timeout, self.name = spec, float(timeout), name or spec
        self.file, self.mtime = source_of(spec, fn)

    def _run(self, args, kwargs, each: bool):
        path = [os.path.abspath(p) for p in sys.path]  # '' and relative entries: this process's working directory
        res = user_pool().submit(run_in_worker, (self.spec, self.file, self.mtime, path, args, kwargs, each),
                                 self.timeout).result()
        if not res.ok:
            if res.reason == "timeout":
                raise RewardTimeout(self.name, self.timeout, "; its worker was replaced")
            raise RewardError(f"its worker failed ({res.reason}): the function crashed its process, or its inputs "
                              "or result do not pickle (rewards.timeout=0 calls it in the trainer process)")
        status, value, text, warns = res.value
        relay(self.name, text, warns)
        if status == "error":
            raise RewardError(value)
        return value

    def __call__(self, *args, **kwargs):
        return self._run(args, kwargs, False)

    def each(self, arg_tuples: Sequence[tuple]) -> List[Tuple[bool, Any]]:
        """One call per argument tuple, all in one worker round trip under one timeout."""
        return self._run(list(arg_tuples), {}, True)


def call_here(name: str, fn: Callable, *args, **kwargs):
    """A user function in this process (rewards.timeout = 0): its stdout captured for the run log
    when a quiet console routes it there (warnings reach the log through logging already)."""
    if not logging.getLogger(OUTPUT_LOGGER).handlers:
        return fn(*args, **kwargs)
    buf, console = io.StringIO(), sys.stdout
    try:
        with contextlib.redirect_stdout(buf), _signals_to(console):
            return fn(*args, **kwargs)
    finally:
        relay(name, buf.getvalue())


@contextlib.contextmanager
def _signals_to(console):
    """While a user function's stdout is captured, a SIGINT / SIGTERM handler (the trainer's
    "stopping after step N", fastgrpo.runs.folder.graceful_signals) still prints to
    `console`, not into the function's output. A handler that replaces itself (a second
    signal) is left as it set it."""
    import signal

    if threading.current_thread() is not threading.main_thread():  # handlers run in the main thread only
        yield
        return
    wrapped = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if not callable(handler):
            continue

        def on_signal(signum, frame, handler=handler):
            captured, sys.stdout = sys.stdout, console
            try:
                handler(signum, frame)
            finally:
                sys.stdout = captured

        signal.signal(sig, on_signal)
        wrapped[sig] = (handler, on_signal)
    try:
        yield
    finally:
        for sig, (handler, on_signal) in wrapped.items():
            if signal.getsignal(sig) is on_signal:
                signal.signal(sig, handler)


class TimedReward:
    """A model reward called in a thread with `timeout` seconds per call (see the module
    docstring); attributes and `metrics()` are the wrapped reward's."""

    takes_inputs = True

    def __init__(self, fn: Callable, name: str, timeout: float):
        self.fn, self.name, self.timeout = fn, name, float(timeout)
        self._running: Optional[threading.Thread] = None
        self.timeouts = 0

    def __getattr__(self, key):
        if key == "fn":  # not set yet (unpickling): no recursion
            raise AttributeError(key)
        return getattr(self.fn, key)

    def __call__(self, inputs):
        if self._running is not None and self._running.is_alive():
            self.timeouts += 1
            raise RewardTimeout(self.name, self.timeout, "; its previous call is still running")
        box: Dict[str, Any] = {}

        def run():
            try:
                box["value"] = self.fn(inputs)
            except BaseException as e:  # noqa: BLE001 — re-raised in the caller's thread
                box["error"] = e

        t = threading.Thread(target=run, name=f"fastgrpo-reward-{self.name}", daemon=True)
        t.start()
        t.join(self.timeout)
        if t.is_alive():
            self._running = t
            self.timeouts += 1
            raise RewardTimeout(self.name, self.timeout, "; the model keeps running in the background")
        if "error" in box:
            raise box["error"]
        return box["value"]
