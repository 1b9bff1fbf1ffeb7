"""RunLock: one process per run folder (issue 14, item 3). A second process is refused with the
holder's pid and host; a holder killed with -9 leaves a record that is taken over with a message;
release lets the next run in."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from fastgrpo.runs.lock import LOCK_NAME, RunLock, RunLockError

TRY = r"""
import sys
from fastgrpo.runs.lock import RunLock, RunLockError
try:
    with RunLock(sys.argv[1], log=lambda m: print("LOG", m)):
        print("ACQUIRED", flush=True)
        if len(sys.argv) > 2:
            sys.stdin.read()  # hold until the parent closes stdin or kills us
except RunLockError as e:
    print("REFUSED", e)
    sys.exit(3)
"""


def _try(out, hold=False):
    return subprocess.Popen([sys.executable, "-c", TRY, str(out)] + (["hold"] if hold else []),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_second_process_is_refused_naming_the_holder(tmp_path):
    with RunLock(str(tmp_path)) as lock:
        assert lock.held and lock.holder()["pid"] == os.getpid()
        p = _try(tmp_path)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 3, out
        assert f"pid {os.getpid()}" in out and socket.gethostname() in out and "in use" in out, out
    p = _try(tmp_path)  # released: the next run gets it, without a take-over message
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and "ACQUIRED" in out and "LOG" not in out, out


def test_killed_holder_is_taken_over_with_a_message(tmp_path):
    p = _try(tmp_path, hold=True)
    assert p.stdout.readline().strip() == "ACQUIRED"
    with pytest.raises(RunLockError, match=f"pid {p.pid} on host"):
        RunLock(str(tmp_path)).acquire()
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    msgs = []
    with RunLock(str(tmp_path), log=msgs.append) as lock:
        assert lock.holder()["pid"] == os.getpid()
        assert len(msgs) == 1 and f"pid {p.pid}" in msgs[0] and "no longer running" in msgs[0], msgs
    assert open(tmp_path / LOCK_NAME).read() == ""  # released: an empty record, the file stays


def test_same_process_twice_is_refused_and_error_is_a_valueerror(tmp_path):
    a = RunLock(str(tmp_path / "run")).acquire()  # creates the folder
    with pytest.raises(ValueError, match="in use by pid"):
        RunLock(str(tmp_path / "run")).acquire()
    a.release()
    a.release()  # idempotent
    with RunLock(str(tmp_path / "run")):
        pass


def test_deleting_the_lock_file_does_not_let_a_second_run_in(tmp_path):
    """issue 26: the lock is on the folder, so removing its record file during a run changes nothing."""
    p = _try(tmp_path, hold=True)
    try:
        assert p.stdout.readline().strip() == "ACQUIRED"
        os.remove(tmp_path / LOCK_NAME)  # what `rm -f runs/x/.fastgrpo-run.lock` (or a cleanup script) does
        q = _try(tmp_path)
        out, _ = q.communicate(timeout=60)
        assert q.returncode == 3 and "REFUSED" in out and "in use by another process" in out, out
        assert not (tmp_path / LOCK_NAME).exists() or "ACQUIRED" not in out
    finally:
        p.kill()
        p.wait(timeout=30)
    q = _try(tmp_path)  # the holder is gone: the folder is free again
    out, _ = q.communicate(timeout=60)
    assert q.returncode == 0 and "ACQUIRED" in out, out
