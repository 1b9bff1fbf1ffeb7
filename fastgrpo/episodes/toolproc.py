"""The process side of tool calls: a warm worker that forks one child per call, in its own session.

A worker (started by ToolExecutor through the multiprocessing fork server) imports the tools
once, then per call forks a child that calls `setsid()` (a new session, hence a new process
group whose id is the child's pid), ties itself to the worker with PR_SET_PDEATHSIG, points
stdin at /dev/null and stdout / stderr at a pipe, runs the function and writes its result to a
second pipe. The worker reads both pipes bounded (the first `4 * max_chars` bytes of print
output are kept, everything after is read and dropped, past `PRINT_LIMIT_BYTES` the call is
stopped), enforces the wall clock, then SIGKILLs the child's process group and sweeps: the
worker is a child subreaper (PR_SET_CHILD_SUBREAPER), so a grandchild that left the group with
its own `setsid()` is re-parented to the worker when its parent dies, and is killed there too.
This is the shell's job-control pattern (one process group per job, killpg) plus the subreaper
sweep of container inits (tini, systemd); the kill-and-respawn of the reward pool (pool.py)
would only stop the worker, not what the tool forked.

Per call this costs one fork of a warm interpreter and two pipes (~1.5 ms of the ~3.5 ms a call
costs end to end, see executor.py) instead of a fresh interpreter that re-imports the tool
(~30 ms). Everything a call's child needs (ctypes, tools.py) is imported before the fork: an
import in the child is paid on every call.
Linux only (prctl, pidfd, /proc).
"""
from __future__ import annotations

import os
import selectors
import signal
import sys
import time
from typing import List, Optional, Tuple

from fastgrpo.episodes.tools import result_text  # imported here, not per call: each call's child is a fresh fork

PRINT_LIMIT_BYTES = 8 << 20  # print output read (and dropped) before the call is stopped as a flood
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_SWEEP_S = 2.0  # how long a sweep keeps killing re-parented descendants (a fork bomb still forking)


_LIBC = None


def _libc():
    """libc through ctypes, loaded once per process (a worker loads it before forking its calls:
    importing ctypes in each call's child would cost ~10 ms)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def proc_table() -> List[Tuple[int, int, int, int, str]]:
    """(pid, ppid, pgrp, session, state) of every process visible in /proc."""
    rows = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                tail = f.read().rsplit(b")", 1)[1].split()
            rows.append((int(entry), int(tail[1]), int(tail[2]), int(tail[3]), tail[0].decode()))
        except (OSError, IndexError, ValueError):
            continue
    return rows


def kill_group(pgid: int) -> None:
    """SIGKILL a process group (gone already: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def wait_group_gone(pgid: int, timeout: float = 2.0) -> int:
    """Kill the group until no live (non-zombie) member is left; returns members still alive
    after `timeout` seconds (0 is the normal answer)."""
    deadline = time.monotonic() + timeout
    while True:
        kill_group(pgid)
        alive = [p for p, _, g, _, st in proc_table() if g == pgid and st not in ("Z", "X")]
        if not alive or time.monotonic() > deadline:
            return len(alive)
        time.sleep(0.002)


def sweep_children() -> int:
    """Reap every child of this process, killing the live ones (members of a killed group that
    are still exiting, or descendants that escaped it with setsid and were re-parented to us).
    Returns how many were still alive after `_SWEEP_S` (0 normally). The common case, no child
    left, costs one waitpid."""
    me = os.getpid()
    deadline = time.monotonic() + _SWEEP_S
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return 0
        alive = [p for p, pp, _, _, st in proc_table() if pp == me and st not in ("Z", "X")]
        for p in alive:
            try:
                os.kill(p, signal.SIGKILL)  # our child: its pid cannot be reused before we reap it
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return len(alive)
        time.sleep(0.0005)


def become_session_leader(parent: int) -> None:
    """In a freshly forked child: own session and process group, and die with `parent`."""
    os.setsid()
    try:
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


# What the fork server imports once, so that a tool worker or an environment process starts
# warm; the reward pool's preload comes first (whichever starts the fork server sets its list).
_PRELOAD = ("fastgrpo.episodes.toolproc", "fastgrpo.episodes.tools", "fastgrpo.episodes.env",
            "fastgrpo.episodes.env_adapters")


def worker_context(method: str = "forkserver"):
    """The multiprocessing context tool workers and environment processes start from. The fork
    server is a clean single-threaded process (forking the threaded trainer could copy held
    locks); `spawn` re-imports everything per process (slower, same behaviour)."""
    import multiprocessing

    if method not in ("forkserver", "spawn"):
        raise ValueError(f"context={method!r}: expected 'forkserver' or 'spawn' (never 'fork': the trainer is "
                         "threaded)")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # only takes effect if the process-wide fork server is not running yet (as in pool.py)
        from fastgrpo.rewards.sandbox.pool import DEFAULT_PRELOAD

        ctx.set_forkserver_preload(list(dict.fromkeys(list(DEFAULT_PRELOAD) + list(_PRELOAD))))
    return ctx


# -- the call child ----------------------------------------------------------------------------
def _child(fn, arguments: dict, parent: int, close_fds: Tuple[int, ...], out_w: int, res_w: int,
           max_chars: int) -> None:
    become_session_leader(parent)
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    for fd in {null, out_w} - {0, 1, 2}:
        os.close(fd)
    try:
        value = fn(**arguments)
        status, text = ("ok", None) if value is None else ("ok", result_text(value))
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the call fails, nothing else
        status, text = "error", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    kind = "n" if text is None else "v"  # n: the tool returned None, its print output is the result
    text = text or ""
    data = f"{status} {kind} {len(text)}\n".encode() + text[:max_chars].encode("utf-8", "replace")
    view = memoryview(data)
    while view:
        view = view[os.write(res_w, view):]
    os._exit(0)


def _read(fd: int, buf: bytearray, keep: int) -> int:
    """Read one chunk into buf, keeping at most `keep` bytes; returns bytes read (0: EOF)."""
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return -1
    if len(buf) < keep:
        buf += chunk[: keep - len(buf)]
    return len(chunk)


def _exit_text(pid: int) -> str:
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        info = None
    if info is None:
        return "the tool process ended without returning a result"
    if info.si_code == os.CLD_EXITED:
        return f"the tool process exited with status {info.si_status} without returning a result"
    try:
        name = signal.Signals(info.si_status).name
    except ValueError:
        name = str(info.si_status)
    return f"the tool process was killed by {name} without returning a result"


def _cut(text: str, max_chars: int, total: Optional[int] = None) -> str:
    total = len(text) if total is None else total
    if total <= max_chars:
        return text
    return text[:max_chars] + f"\n...[{total - max_chars} more characters cut]"


def run_call(conn, fn, arguments: dict, timeout: float, max_chars: int) -> Tuple[str, str, int]:
    """Run one call in a child session; (status, text for the model, processes that outlived the
    sweep). Sends ("pid", child pid) on `conn` first, so the executor can kill the group if this
    worker dies."""
    out_r, out_w = os.pipe()
    res_r, res_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _child(fn, arguments, parent, (conn.fileno(), out_r, res_r), out_w, res_w, max_chars)
        finally:
            os._exit(70)
    os.close(out_w)
    os.close(res_w)
    status, text = "error", ""
    try:
        conn.send(("pid", pid))
        status, text = _supervise(pid, out_r, res_r, timeout, max_chars)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # before setsid the child is not a group leader yet
        except ProcessLookupError:
            pass
        kill_group(pid)  # the child is unreaped, so its pid (the group id) cannot be reused yet
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        left = sweep_children()
        os.close(out_r)
        os.close(res_r)
    return status, text, left


def _supervise(pid: int, out_r: int, res_r: int, timeout: float, max_chars: int) -> Tuple[str, str]:
    deadline = time.monotonic() + timeout
    keep_out, keep_res = 4 * max_chars + 4, 4 * max_chars + 64
    out, res = bytearray(), bytearray()
    printed = 0
    try:
        pidfd: Optional[int] = os.pidfd_open(pid)
    except (AttributeError, OSError):  # kernel < 5.3: poll the child every 10 ms instead
        pidfd = None
    sel = selectors.DefaultSelector()
    for fd in (out_r, res_r):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    if pidfd is not None:
        sel.register(pidfd, selectors.EVENT_READ)
    exited = False
    try:
        while not exited:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", f"Error: the tool did not finish within {timeout:g} s and was stopped"
            for key, _ in sel.select(left if pidfd is not None else min(left, 0.01)):
                if key.fd == pidfd:
                    exited = True
                    continue
                n = _read(key.fd, out if key.fd == out_r else res, keep_out if key.fd == out_r else keep_res)
                if n == 0:
                    sel.unregister(key.fd)
                elif key.fd == out_r and n > 0:
                    printed += n
                    if printed > PRINT_LIMIT_BYTES:
                        return "error", (f"Error: the tool printed more than {PRINT_LIMIT_BYTES >> 20} MiB "
                                         "and was stopped")
            if pidfd is None and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                exited = True
        # The child has exited: what it wrote is in the pipes. Drain without waiting for EOF, which
        # never comes while a grandchild still holds the write ends.
        for fd, buf, keep in ((res_r, res, keep_res), (out_r, out, keep_out)):
            got = 0
            while got <= PRINT_LIMIT_BYTES:
                n = _read(fd, buf, keep)
                if n <= 0:
                    break
                got += n
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    head, sep, body = bytes(res).partition(b"\n")
    parts = head.decode("ascii", "replace").split()
    if not sep or len(parts) != 3 or parts[0] not in ("ok", "error") or not parts[2].isdigit():
        return "error", "Error: " + _exit_text(pid)
    status, kind, total = parts[0], parts[1], int(parts[2])
    text = body.decode("utf-8", "replace")
    if kind == "n":  # returned None: what it printed is the answer
        printed_text = bytes(out).decode("utf-8", "replace").rstrip("\n")
        text, total = printed_text, max(printed, len(printed_text))
    text = _cut(text, max_chars, total if total > len(text) else None)
    return status, text if status == "ok" else "Error: " + text


# -- the worker --------------------------------------------------------------------------------
def worker_main(conn, wire: dict) -> None:
    """A tool worker: imports every tool of `wire` ({name: (origin, paths) or function}) once,
    then serves ("call", name, arguments, timeout, max_chars) messages until None or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the owner decides
    try:
        lc = _libc()
        lc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        lc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a call come to us, not to init
    except Exception:
        pass
    from fastgrpo.episodes.tools import reimport

    fns, broken = {}, {}
    for name, where in wire.items():
        try:
            fns[name] = where if callable(where) else reimport(*where)
        except BaseException as e:
            broken[name] = f"{type(e).__name__}: {e}"
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        _, name, arguments, timeout, max_chars = msg
        t0 = time.monotonic()
        if name not in fns:
            conn.send(("done", "error", f"Error: tool '{name}' failed to import in its worker: "
                                        f"{broken.get(name, 'unknown tool')}", 0.0, 0))
            continue
        status, text, left = run_call(conn, fns[name], arguments, timeout, max_chars)
        conn.send(("done", status, text, time.monotonic() - t0, left))
