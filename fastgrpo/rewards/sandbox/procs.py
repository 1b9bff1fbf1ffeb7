"""Process plumbing shared by the verifier pool (pool.py) and the code sandbox (runner.py):
libc through ctypes, the worker-side state a task reads, killing every process of a sandbox
uid, and reaping a subreaper's exited children. Linux only (prctl, unshare, /proc).
"""
from __future__ import annotations

import ctypes
import os
import signal
import time

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# Sandboxed children run as uid SANDBOX_UID_BASE + worker pid: unique per live worker, far from
# real accounts, so RLIMIT_NPROC is counted per worker and "kill every process of this uid"
# after a run cannot touch anything else (pid_max ≤ 4_194_304 keeps it inside uid_t).
SANDBOX_UID_BASE = 1_000_000

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


# Worker-side state, read by the tasks (e.g. the sandbox needs its uid and isolation level).
WORKER_STATE: dict = {}


def _state(pid: str) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1][1:2].decode()


def kill_uid(uid: int) -> int:
    """SIGKILL every live process owned by `uid` (a sandbox user id); returns how many were
    signalled. Loops because a fork bomb may still be forking while we kill; zombies are
    skipped (already dead, their parent or the subreaper collects them)."""
    total = 0
    for _ in range(100):
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid or _state(entry) == "Z":
                    continue
                os.kill(int(entry), signal.SIGKILL)
                found += 1
            except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
                continue
        total += found
        if not found:
            return total
        time.sleep(0.002)
    return total


def reap_children(max_wait: float = 0.2) -> None:
    """Collect exited children (this worker is a subreaper for its sandbox runs)."""
    deadline = time.monotonic() + max_wait
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)
