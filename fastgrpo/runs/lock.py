"""One process per run folder: `RunLock(out_dir)`, held for the lifetime of a run.

The lock is `flock(2)` on the run folder itself (a descriptor of the directory, kept open until
`release()`): the kernel drops it when the holder exits however it exits (kill -9, OOM), so
there is no stale lock to clean by hand, and two processes can never both hold it (the check and
the take are one system call; a pid file alone races). Locking the folder rather than a file in
it means that deleting files of the folder — the lock record among them — cannot let a second
run in (a lock on a file is a lock on its inode: a newcomer that creates the file anew locks
another inode, and both runs write the same folder). The record `<out_dir>/.fastgrpo-run.lock`
(pid, host, start time, JSON) only names the holder in the messages: a live holder makes
`RunLock` raise `RunLockError` (a ValueError) naming its pid and host; a record left by a holder
that is gone is taken over with a one-line message. This is the scheme of `flock(1)` on a
directory; departure: the record is JSON, for the message.

Limits: on a network file system `flock` is only as good as its lock manager (NFSv4 and Lustre
honour it across hosts; some FUSE mounts do not lock at all, and then the pid record of a live
holder on this host is the only guard). A child process that inherited the descriptor by
`fork()` keeps the lock until it exits too (the descriptor is close-on-exec, so an exec'd one
does not). A run folder that is itself deleted and made again is a new folder, unlocked.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from typing import Callable, Optional

from fastgrpo.runs.checkpoint import pid_alive

LOCK_NAME = ".fastgrpo-run.lock"


class RunLockError(ValueError):
    """The run folder is locked by another live process (pid and host in the message)."""

    def __init__(self, msg: str, holder: Optional[dict] = None):
        super().__init__(msg)
        self.holder = holder or {}


def _describe(h: dict) -> str:
    when = h.get("started")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) else "?"
    return f"pid {h.get('pid', '?')} on host {h.get('host', '?')} (started {since})"


class RunLock:
    """Exclusive lock of a run folder for one process; a context manager.

    Args:
        out_dir: the run folder (created when missing).
        log: where the take-over message goes (default: print).

    `with RunLock(out): ...` or `acquire()` / `release()`; `holder()` reads the record.
    """

    def __init__(self, out_dir: str, log: Optional[Callable[[str], None]] = None):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_NAME)
        self.log = log or print
        self._fd: Optional[int] = None

    def holder(self) -> dict:
        """The record in the lock file ({} when empty, missing or unreadable)."""
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        os.makedirs(self.out_dir, exist_ok=True)
        fd = os.open(self.out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    self._no_flock(e)  # raises if the record names a live holder here
                else:
                    h = self.holder()
                    gone = (h.get("host") == socket.gethostname() and isinstance(h.get("pid"), int)
                            and not pid_alive(h["pid"]))
                    extra = (" (that process has exited, but a process it forked still holds the lock)"
                             if gone else "")
                    who = _describe(h) if h.get("pid") is not None else (
                        f"another process (its record {self.path} was removed or emptied)")
                    raise RunLockError(f"run folder {self.out_dir} is in use by {who}{extra}: wait for that "
                                       "run to end (or stop it), or give this run another --out folder", h) from None
            old = self.holder()
            if old.get("pid") is not None:
                self.log(f"[fastgrpo] run folder {self.out_dir}: taking over the lock of {_describe(old)}, "
                         "which is no longer running")
            record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
            self._write_record(record.encode() + b"\n")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _write_record(self, data: bytes, create: bool = True) -> None:
        flags = os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        try:
            rfd = os.open(self.path, flags, 0o644)
        except FileNotFoundError:
            return
        try:
            os.ftruncate(rfd, 0)
            if data:
                os.pwrite(rfd, data, 0)
            os.fsync(rfd)
        finally:
            os.close(rfd)

    def _no_flock(self, err: OSError) -> None:
        """The file system does not lock: fall back to the pid record (same host only)."""
        h = self.holder()
        if (h.get("host") == socket.gethostname() and isinstance(h.get("pid"), int) and h["pid"] != os.getpid()
                and pid_alive(h["pid"])):
            raise RunLockError(f"run folder {self.out_dir} is in use by {_describe(h)} (this file system does not "
                               f"support flock: {err.strerror}); wait for that run to end or use another --out", h)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            self._write_record(b"", create=False)  # an empty record: nobody to take over from
        except OSError:
            pass
        finally:
            os.close(fd)  # drops the flock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass
