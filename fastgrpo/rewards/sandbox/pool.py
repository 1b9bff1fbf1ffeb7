"""A persistent pool of verifier worker processes with a bounded queue and a hard per-item timeout.

Why not `multiprocessing.Pool` / `concurrent.futures.ProcessPoolExecutor`: neither can stop one
runaway task. Math-Verify's own timeout is `signal.alarm`, which only works in a main thread and
cannot interrupt a long C call (a 10**10**10 big-integer power never returns to the interpreter),
and hostile code can ignore signals. Here every task runs in the main thread of a worker process
and the parent enforces the deadline from outside: a worker that overruns is SIGKILLed and
replaced, and its item scores a `timeout` reason. Design follows the "one task in flight per
worker, kill-and-respawn on overrun" pattern of judge systems (e.g. verl's sandbox fusion, DMOJ).

- bounded queue: `submit` puts into a `queue.Queue(max_pending)` and blocks (or raises
  `queue.Full` after `block_timeout`) when it is full, so a flood of work cannot grow memory
  without bound; at most one item per worker is in flight, so a kill loses exactly one item.
- context: `forkserver` by default. Forking the trainer directly would copy a threaded torch
  process (locks held by other threads stay locked in the child); the fork server is a clean
  single-threaded process that imports the verifier modules once (`preload`), so a replacement
  worker starts in milliseconds instead of the ~1 s a `spawn` worker needs to import sympy.
- isolation set up once per worker: RLIMIT_AS (a verifier blowing memory dies alone), a death
  signal tied to its parent, and a new empty network namespace (as root directly, otherwise
  inside an unprivileged user namespace) that every sandboxed child inherits (one namespace per
  worker: creating one per run is slow in the kernel).
- clean shutdown: `close()` fails pending futures with reason `closed`, stops the workers (kill
  after a grace period) and kills every process left under the workers' sandbox user ids.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, List, Optional, Sequence, Tuple

from fastgrpo.rewards.sandbox.procs import (CLONE_NEWNET, CLONE_NEWUSER, PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG,
                                            SANDBOX_UID_BASE, WORKER_STATE, kill_uid, libc)

logger = logging.getLogger(__name__)

DEFAULT_PRELOAD = ("fastgrpo.rewards._preload",)


@dataclass
class TaskResult:
    """Outcome of one pool item: `ok` and `value` when the function returned; otherwise `reason`
    is `timeout`, `worker_crash`, `closed` or `error:<ExceptionType>`."""

    ok: bool
    value: Any = None
    reason: Optional[str] = None
    seconds: float = 0.0


def _worker_init(memory_limit_mb: Optional[int], isolate_network: bool) -> None:
    import resource

    try:
        libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # Orphans of a sandbox run (a fork bomb's children) reparent to this worker, which
        # reaps them, instead of piling up as zombies under init.
        libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:  # not Linux: the EOF on the task pipe still ends the worker
        pass
    if memory_limit_mb:
        limit = int(memory_limit_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    root = os.geteuid() == 0
    netns = False
    if isolate_network:
        # Root: a plain new network namespace. Otherwise an unprivileged user namespace owning
        # a new network namespace (allowed on most distributions; bubblewrap relies on the same).
        flags = CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET
        netns = libc().unshare(flags) == 0
    WORKER_STATE.update(netns=netns, root=root, sandbox_uid=SANDBOX_UID_BASE + os.getpid() if root else None)


def _worker_main(conn, memory_limit_mb, isolate_network) -> None:
    # Ctrl-C in the trainer reaches the whole foreground group: the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_init(memory_limit_mb, isolate_network)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        func, args = msg
        t0 = time.perf_counter()
        try:
            out = (True, func(*args), None)
        except BaseException as e:  # a verifier bug scores 0 with a reason, it never kills us
            out = (False, None, f"error:{type(e).__name__}")
        try:
            conn.send(out + (time.perf_counter() - t0,))
        except Exception as e:  # unpicklable value
            conn.send((False, None, f"error:{type(e).__name__}", time.perf_counter() - t0))



class _Slot:
    __slots__ = ("proc", "conn", "future", "deadline", "started")

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.future = None
        self.deadline = 0.0
        self.started = 0.0


class RewardPool:
    """Persistent process pool for verifiers.

    Args:
        num_workers: worker processes (default: CPUs available to this process).
        context: multiprocessing start method, `forkserver` (default), `spawn` or `fork`.
        max_pending: capacity of the submission queue (items waiting for a worker).
        memory_limit_mb: RLIMIT_AS of each worker (None: unlimited).
        isolate_network: give each worker a new empty network namespace (as root directly,
            otherwise inside an unprivileged user namespace when the kernel allows it).
        preload: modules the fork server imports once (forkserver only).

    `map(func, arg_tuples, timeout)` is the batch call; `submit` returns a Future of TaskResult.
    Use as a context manager or call `close()`; an atexit hook closes pools left open.
    """

    def __init__(self, num_workers: Optional[int] = None, context: str = "forkserver", max_pending: int = 4096,
                 memory_limit_mb: Optional[int] = 2048, isolate_network: bool = True,
                 preload: Sequence[str] = DEFAULT_PRELOAD):
        if num_workers is None:
            num_workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r}: expected a positive int")
        if context not in ("forkserver", "spawn", "fork"):
            raise ValueError(f"context={context!r}: expected 'forkserver', 'spawn' or 'fork'")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending={max_pending!r}: expected a positive int")
        self.num_workers = num_workers
        self._ctx = multiprocessing.get_context(context)
        if context == "forkserver" and preload:
            # Only takes effect if the process-wide fork server is not running yet; otherwise
            # workers import on first use (slower start, same behaviour).
            self._ctx.set_forkserver_preload(list(preload))
        self._worker_args = (memory_limit_mb, isolate_network)
        self._pending: "queue.Queue" = queue.Queue(maxsize=max_pending)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._broken = False
        self._pid = os.getpid()  # a forked copy of the pool has no dispatcher: see submit/close
        self._lock = threading.Lock()
        self.stats = {"timeouts": 0, "crashes": 0, "respawns": 0, "completed": 0}
        t0 = time.perf_counter()
        self._slots: List[_Slot] = [self._spawn() for _ in range(num_workers)]
        self.startup_seconds = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._dispatch, name="fastgrpo-reward-pool", daemon=True)
        self._thread.start()
        _LIVE_POOLS.add(self)

    # -- public -----------------------------------------------------------------------------
    def submit(self, func: Callable, args: Tuple, timeout: float, block_timeout: Optional[float] = None
               ) -> "concurrent.futures.Future[TaskResult]":
        """Queue `func(*args)` with a hard `timeout` in seconds (from when a worker takes it).
        Blocks while the queue is full; raises queue.Full after `block_timeout` seconds."""
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout={timeout!r}: expected a positive number of seconds")
        if os.getpid() != self._pid:
            raise RuntimeError("RewardPool was created in another process (this one is a fork); create a new "
                               "pool here")
        if self._closed or self._broken:
            raise RuntimeError("RewardPool is closed" if self._closed else "RewardPool dispatcher failed (see log)")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending.put((func, tuple(args), float(timeout), fut), timeout=block_timeout)
        self._wake()
        return fut

    def map(self, func: Callable, arg_tuples: Sequence[Tuple], timeout: float) -> List[TaskResult]:
        """Run func over every argument tuple; results in input order, one TaskResult each."""
        futures = []
        for args in arg_tuples:
            futures.append(self.submit(func, args, timeout))
        return [f.result() for f in futures]

    def isolation_level(self) -> str:
        """What the code sandbox enforces in this pool's workers (see sandbox.isolation_level)."""
        from fastgrpo.rewards.sandbox.runner import isolation_level

        res = self.map(isolation_level, [()], timeout=30.0)[0]
        return res.value if res.ok else f"unknown ({res.reason})"

    def worker_pids(self) -> List[int]:
        return [s.proc.pid for s in self._slots if s.proc.pid is not None]

    def sandbox_uids(self) -> List[int]:
        return [SANDBOX_UID_BASE + pid for pid in self.worker_pids()]

    def close(self, grace: float = 2.0) -> None:
        """Stop the pool: pending items get reason `closed`, workers exit (or are killed after
        `grace` seconds), sandbox processes are killed. Idempotent; a no-op in a forked child,
        whose copy must not stop the parent's workers."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join()
        while True:
            try:
                _, _, _, fut = self._pending.get_nowait()
            except queue.Empty:
                break
            fut.set_result(TaskResult(False, reason="closed"))
        for s in self._slots:
            if s.future is not None:
                s.future.set_result(TaskResult(False, reason="closed"))
                s.future = None
                s.proc.kill()
            try:
                s.conn.send(None)
            except Exception:
                pass
        deadline = time.monotonic() + grace
        for s in self._slots:
            s.proc.join(max(0.0, deadline - time.monotonic()))
            if s.proc.is_alive():
                s.proc.kill()
                s.proc.join()
            self._reap(s)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        _LIVE_POOLS.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _wake(self):
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # pipe full means a wake-up is already pending
            pass

    def _spawn(self) -> _Slot:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child_conn,) + self._worker_args,
                                 name="fastgrpo-reward-worker", daemon=True)
        proc.start()
        child_conn.close()
        return _Slot(proc, parent_conn)

    def _reap(self, s: _Slot):
        s.conn.close()
        if s.proc.pid is not None and os.geteuid() == 0:
            kill_uid(SANDBOX_UID_BASE + s.proc.pid)
        s.proc.close()

    def _replace(self, i: int, result: Optional[TaskResult]):
        s = self._slots[i]
        if s.proc.is_alive():
            s.proc.kill()
        s.proc.join()
        fut = s.future
        self._reap(s)
        self.stats["respawns"] += 1
        self._slots[i] = self._spawn()
        if fut is not None and result is not None:
            fut.set_result(result)

    def _dispatch(self):
        try:
            while not self._closed:
                self._step()
        except BaseException:  # a dispatcher bug must fail the items, never hang the trainer
            logger.exception("RewardPool dispatcher failed; failing pending items")
            self._broken = True
            for s in self._slots:
                if s.future is not None and not s.future.done():
                    s.future.set_result(TaskResult(False, reason="pool_error"))
                    s.future = None
            while True:
                try:
                    self._pending.get_nowait()[3].set_result(TaskResult(False, reason="pool_error"))
                except queue.Empty:
                    break

    def _send(self, i: int, func, args, timeout: float, fut) -> None:
        s = self._slots[i]
        if not s.proc.is_alive():  # died while idle (e.g. the OOM killer): replace first
            self.stats["crashes"] += 1
            self._replace(i, None)
            s = self._slots[i]
        s.future, s.started = fut, time.monotonic()
        s.deadline = s.started + timeout
        try:
            s.conn.send((func, args))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self.stats["crashes"] += 1
            self._replace(i, TaskResult(False, reason="worker_crash"))
        except Exception as e:  # the task does not pickle
            s.future = None
            fut.set_result(TaskResult(False, reason=f"error:{type(e).__name__}"))

    def _step(self):
        for i, s in enumerate(self._slots):
            if s.future is None:
                try:
                    func, args, timeout, fut = self._pending.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    self._send(i, func, args, timeout, fut)
        busy = [s for s in self._slots if s.future is not None]
        now = time.monotonic()
        wait_s = max(0.0, min((s.deadline for s in busy), default=now + 1.0) - now)
        ready = _mp_wait([s.conn for s in busy] + [self._wake_r], timeout=wait_s)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        now = time.monotonic()
        for i, s in enumerate(self._slots):
            if s.future is None:
                continue
            if s.conn in ready:
                try:
                    ok, value, reason, secs = s.conn.recv()
                except (EOFError, OSError):
                    self.stats["crashes"] += 1
                    self._replace(i, TaskResult(False, reason="worker_crash", seconds=now - s.started))
                    continue
                fut, s.future = s.future, None
                self.stats["completed"] += 1
                fut.set_result(TaskResult(ok, value, reason, secs))
            elif now >= s.deadline:
                self.stats["timeouts"] += 1
                self._replace(i, TaskResult(False, reason="timeout", seconds=now - s.started))


_LIVE_POOLS: "weakref.WeakSet[RewardPool]" = weakref.WeakSet()
_DEFAULT_POOL: Optional[RewardPool] = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> RewardPool:
    """The process-wide pool the reward functions use when no `pool=` is given (created on first
    use, closed at exit). A trainer that wants control creates its own RewardPool."""
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is None or _DEFAULT_POOL._closed or _DEFAULT_POOL._pid != os.getpid():
            _DEFAULT_POOL = RewardPool()
        return _DEFAULT_POOL


@atexit.register
def _close_all():
    for p in list(_LIVE_POOLS):
        try:
            p.close(grace=0.5)
        except Exception:
            logger.exception("closing RewardPool at exit")
