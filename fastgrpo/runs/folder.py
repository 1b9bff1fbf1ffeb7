"""What a run does to its run folder and its process beyond the checkpoints: its temporary
files live inside the folder, and SIGINT / SIGTERM end it with a checkpoint.

- `run_tmpdir(out_dir)`: for the run's lifetime `tempfile` (and TMPDIR, which vLLM's engine
  processes inherit) point at `<out_dir>/tmp`, made absolute here once (a relative `--out` handed
  to a process with another working directory — vLLM's compiler — would name another folder), so
  model snapshots for the vLLM engine, vLLM's own `vllm_dist_*` folders, torch's compiler cache
  (TORCHINDUCTOR_CACHE_DIR, unless the user set it) and multiprocessing's `pymp-*` folder never
  land in the machine's /tmp. The folder is emptied when the run ends and at the next start (what
  a kill -9 left behind), so nothing outlives the run folder even then. A multiprocessing folder
  is the exception while its process lives — this one's, another rank's of the same run (marked
  with its owner's pid and start time), a child's (its fork server's socket is bound): it may
  outlive the run in a library user's process, so it stays until that process exits
  (multiprocessing removes it then, and `<out_dir>/tmp` after it; removed earlier, that exit
  printed a FileNotFoundError traceback after every early stop and two-rank run); where its
  socket path would be too long for AF_UNIX (108 bytes) it stays in the system temp folder.
- `route_compiler_cache(out_dir)`: torch creates its compiler cache folder when transformers
  first imports torch._dynamo, before a run starts; the CLI calls this first, and
  `discard_unused(out_dir)` removes the folder again when the command fails before the run.
- `describe_os_error(e)`: the one line of an expected OS failure (no space, read-only file
  system, permission, a file where a folder belongs) found in `e` or its causes — safetensors
  reports ENOSPC only in its message — or None. `saving(what, path)` around a writer turns its
  failure on a full disk, in whatever form (torch.save's C++ stream names no errno: the file
  system is then found full), into one OSError naming `path` and `what` ("… while saving the
  checkpoint of step 2").
- `graceful_signals(request_stop)`: the first SIGINT / SIGTERM calls `request_stop(signum)`
  (the trainer finishes its step, checkpoints and raises `TrainingInterrupted`); a second one
  interrupts at once (`RunInterrupted`, a KeyboardInterrupt). Outside the GRPO loop
  (`request_stop=None`) the first signal interrupts at once: SFT, model loading and evaluation
  are redone on resume. `where()` says what the run had done by then, for the message (after
  the final checkpoint it is not "before any GRPO step"). A process forked while the handler is
  installed (a `fork` pool's worker) gets the signal's default action, never the run's stop.
- `exit_deadline(on)`: a run that a signal stops ends within STOP_GRACE_S even when its cleanup
  blocks (a child that does not exit, a thread never joined, a user reward that swallows the
  interrupt): `stop_deadline(code, line)`, armed when the stop is decided, prints the line and
  ends the process with `code`. Only the command line turns it on: a library caller's process is
  never ended behind its back.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from typing import Callable, Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    """A run ended by SIGINT / SIGTERM after writing its checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint} written" if checkpoint else "no new checkpoint (nothing trained since the last)"
        super().__init__(f"interrupted by {name} after step {step}: {where}; run the same command to resume")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


_INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"
_routed = {"inductor": None}  # the compiler cache folder this module set (not the user's)


def _ours(value: Optional[str]) -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR may be pointed elsewhere: unset, set by us, or torch's
    default (torch writes its default into the environment on first use)."""
    return value is None or value == _routed["inductor"] or os.path.basename(value).startswith("torchinductor_")


def route_compiler_cache(out_dir: str) -> Optional[str]:
    """Point torch's compiler cache at `<out_dir>/tmp/torchinductor` (absolute) unless the user
    chose a folder; returns the previous value."""
    old = os.environ.get(_INDUCTOR)
    if _ours(old):
        _routed["inductor"] = os.path.join(os.path.abspath(out_dir), "tmp", "torchinductor")
        os.environ[_INDUCTOR] = _routed["inductor"]
    return old


def restore_compiler_cache(old: Optional[str], out_dir: Optional[str] = None) -> None:
    """Undo `route_compiler_cache` (its return value), for a process that goes on after the run;
    with `out_dir`, the cache folder goes too when nothing was compiled into it (torch creates it
    empty at import: `sft`, `eval`, `bench` and `fuse` left `<run>/tmp/torchinductor` behind)."""
    routed = _routed["inductor"]
    if out_dir is not None and routed == os.path.join(os.path.abspath(out_dir), "tmp", "torchinductor"):
        _rmdir_quietly(routed)
        _rmdir_quietly(os.path.dirname(routed))  # <run>/tmp, when that leaves it empty
    if old is None:
        os.environ.pop(_INDUCTOR, None)
    else:
        os.environ[_INDUCTOR] = old


def discard_unused(out_dir: str) -> None:
    """After a command that failed before its run began: remove `<out_dir>/tmp` (but a live
    process's multiprocessing folder: this one's, whose exit removes it) and then the folder
    itself when that leaves it empty (the caller knows it did not exist before)."""
    _clear_and_remove(os.path.join(out_dir, "tmp"))
    with contextlib.suppress(OSError):
        os.rmdir(out_dir)


def _mp_tempdir() -> Optional[str]:
    import multiprocessing.process

    return multiprocessing.process.current_process()._config.get("tempdir")


_OWNER = ".fastgrpo-owner"  # in a pymp-* folder: "<pid> <start time>" of the process whose folder it is


def _process_id(pid: int) -> Optional[str]:
    """"<pid> <start time>" of a live process (a pid reused by another process reads otherwise)."""
    import psutil

    try:
        return f"{pid} {psutil.Process(pid).create_time():.3f}"
    except psutil.Error:
        return None


def _mark_owner(mp_dir: str) -> None:
    """Name this process as the owner of its multiprocessing folder, so that another rank of the
    same run (or the next start) keeps it while this process lives and removes it after."""
    with contextlib.suppress(OSError):
        with open(os.path.join(mp_dir, _OWNER), "w") as f:
            f.write(_process_id(os.getpid()) or "")


def _bound_sockets() -> set:
    """Paths of the bound AF_UNIX sockets of this machine (/proc/net/unix, Linux): a fork
    server's listener is one while its process lives."""
    try:
        with open("/proc/net/unix") as f:
            return {cols[-1] for cols in (line.split() for line in f.readlines()[1:]) if len(cols) >= 8}
    except OSError:
        return set()


def _live_mp_dir(entry: str, sockets: set) -> bool:
    """Whether the `pymp-*` folder `entry` belongs to a live process: its owner mark names one
    (this run's other ranks, a library user's earlier run), or a socket in it is bound (a child's
    fork server). multiprocessing removes such a folder itself when its process exits; removing it
    first makes that exit print a FileNotFoundError traceback (issue 34)."""
    try:
        with open(os.path.join(entry, _OWNER)) as f:
            owner = f.read().strip()
    except OSError:
        owner = ""
    if owner:
        return _process_id(int(owner.split()[0])) == owner
    return any(sock.startswith(entry + os.sep) for sock in sockets)


def _clear(path: str, keep: Optional[str] = None) -> None:
    """Empty `path` except `keep` and every multiprocessing folder of a live process."""
    if not os.path.isdir(path):
        return
    sockets = None
    for name in os.listdir(path):
        entry = os.path.join(path, name)
        if keep is not None and os.path.abspath(entry) == os.path.abspath(keep):
            continue
        if name.startswith("pymp-") and os.path.isdir(entry):
            sockets = _bound_sockets() if sockets is None else sockets
            if _live_mp_dir(os.path.abspath(entry), sockets):
                continue
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(entry)


def _clear_and_remove(path: str) -> None:
    """`_clear` (keeping this process's multiprocessing folder too), then the folder itself when
    nothing live is left in it (multiprocessing's exit, then `_rmdir_quietly`, remove the rest)."""
    _clear(path, keep=_mp_tempdir())
    _rmdir_quietly(path)


# AF_UNIX socket paths hold 107 bytes: "<tmp>/pymp-xxxxxxxx/listener-xxxxxxxx" must fit
_MP_PATH_MAX = 107 - len("/pymp-xxxxxxxx/listener-xxxxxxxx")


@contextlib.contextmanager
def run_tmpdir(out_dir: str) -> Iterator[str]:
    import multiprocessing.util

    path = os.path.abspath(os.path.join(out_dir, "tmp"))  # absolute once: handed to other processes
    mp_dir = _mp_tempdir()
    _clear(path, keep=mp_dir)  # left by a run that was killed (another rank's live folder stays)
    os.makedirs(path, exist_ok=True)
    old_dir, old_env = tempfile.tempdir, os.environ.get("TMPDIR")
    old_inductor = os.environ.get(_INDUCTOR)
    tempfile.tempdir = path
    os.environ["TMPDIR"] = path
    if _ours(old_inductor):
        _routed["inductor"] = os.path.join(path, "torchinductor")
        os.environ[_INDUCTOR] = _routed["inductor"]
    if mp_dir is None and len(path) <= _MP_PATH_MAX:
        # multiprocessing's folder (the fork server's socket) inside the run folder: removed by
        # multiprocessing at exit (priority -100), then <out_dir>/tmp by this finalizer
        mp_dir = multiprocessing.util.get_temp_dir()
        _mark_owner(mp_dir)
        multiprocessing.util.Finalize(None, _rmdir_quietly, args=(path,), exitpriority=-101)
    else:
        multiprocessing.util.get_temp_dir()  # created now, outside the run folder (too long a path for its socket)
    try:
        yield path
    finally:
        tempfile.tempdir = old_dir
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        if _ours(old_inductor) and old_inductor is not None:
            os.environ[_INDUCTOR] = old_inductor
        elif old_inductor is None:
            os.environ.pop(_INDUCTOR, None)
        _clear_and_remove(path)


def _rmdir_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


_OS_HINTS = {
    errno.ENOSPC: "the disk is full: free space (or give --out a folder on another disk) and run the same command "
                  "to resume from the last checkpoint",
    errno.EDQUOT: "the disk quota is used up: free space and run the same command to resume from the last checkpoint",
    errno.EROFS: "the file system is read-only: give --out a folder on a writable one",
    errno.EACCES: "permission denied: give --out a folder you may write (or fix its permissions)",
    errno.EPERM: "operation not permitted: give --out a folder you may write (or fix its permissions)",
    errno.ENOTDIR: "a file stands where a folder belongs: give --out a new or existing run folder, not a file",
    errno.EEXIST: "a file stands where a folder belongs: give --out a new or existing run folder, not a file",
}
# safetensors' (Rust) io::Error, e.g. code 28 = ENOSPC: `Os { code: 28, … }` (Debug, older releases) or
# `No space left on device (os error 28)` (Display, 0.4+: the form this regex missed, issue 34)
_RUST_OS = re.compile(r"Os \{ code: (\d+)|\(os error (\d+)\)")


def _os_errors(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


_WRITING = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # about a write wherever the file is


def describe_os_error(e: BaseException, out_dir: Optional[str] = None) -> Optional[str]:
    """One line for an expected OS failure in `e` or its causes (the file, the reason, what to
    do), or None when there is none. Permission and not-a-folder errors count only on the run
    folder `out_dir` (or with no file named): elsewhere — a config file, a data file — the
    caller's own message is the better one."""
    root = os.path.abspath(out_dir) if out_dir else None
    for err in _os_errors(e):
        code = getattr(err, "errno", None) if isinstance(err, OSError) else None
        if code is None:
            m = _RUST_OS.search(str(err))
            code = int(m.group(1) or m.group(2)) if m else None
        if code not in _OS_HINTS:
            continue
        name = getattr(err, "filename", None) if isinstance(err, OSError) else None
        if code not in _WRITING and name and root is not None:
            full = os.path.abspath(str(name))
            if full != root and not full.startswith(root + os.sep):
                continue
        where = f"{name}: " if name else ""
        what = getattr(err, "saving", None)  # raised by `saving`: what was being written there
        doing = f" while saving {what}" if what else ""
        return f"{where}{os.strerror(code)}{doing} — {getattr(err, 'advice', None) or _OS_HINTS[code]}"
    return None


# Free bytes below which a write error that names no errno is taken for a full disk: torch.save to a
# path writes through a C++ stream that reports ENOSPC as "basic_ios::clear: iostream error" /
# "unexpected pos …", with no errno anywhere (fastgrpo.runs.checkpoint writes through Python files,
# which keep it; a library's own writer — DeepSpeed's — may not).
FULL_BYTES = 1 << 20


def disk_full(path: str) -> bool:
    """True when the file system holding `path` (or its nearest existing parent) has less than
    FULL_BYTES free for this user."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BYTES


@contextlib.contextmanager
def saving(what: str, path: str, advice: Optional[str] = None) -> Iterator[None]:
    """Writing `what` ("the checkpoint of step 12") to `path`: an expected OS failure inside (a full
    disk, a quota, a read-only file system, in whatever form the writer reported it: an OSError, a
    cause of another error, safetensors' message, torch's errno-less stream error on a full disk)
    is raised again as one OSError naming `path` and `what` (its `saving`), from the original, so
    `describe_os_error` makes the one line of it. `advice` replaces the hint of a full disk or
    quota (an export has no --out and nothing to resume). Anything else passes unchanged. Enter it
    inside the writer's cleanup: the partial files still hold their space when the disk is checked."""
    try:
        yield
    except Exception as e:
        if isinstance(e, OSError) and getattr(e, "saving", None):
            raise
        code = None
        for err in _os_errors(e):
            c = getattr(err, "errno", None) if isinstance(err, OSError) else None
            if c is None:
                m = _RUST_OS.search(str(err))
                c = int(m.group(1) or m.group(2)) if m else None
            if c in _OS_HINTS:
                code = c
                break
        if code is None and disk_full(path):
            code = errno.ENOSPC
        if code is None:
            raise
        err = OSError(code, os.strerror(code), path)
        err.saving, err.advice = what, advice if code in (errno.ENOSPC, errno.EDQUOT) else None
        raise err from e


class RunInterrupted(KeyboardInterrupt):
    """A run stopped at once by a signal; `str()` is the signal's name (as KeyboardInterrupt's
    was), `where` the phrase saying what the run had done ("before any GRPO step finished", …)."""

    def __init__(self, signame: str, where: Optional[str] = None):
        super().__init__(signame)
        self.signame, self.where = signame, where


# Seconds a run stopped by a signal may take to end once the stop is decided (its checkpoint, if
# any, is written by then): cleanup that blocks longer is cut short (`stop_deadline`).
STOP_GRACE_S = 30.0
_DEADLINE = {"on": False, "armed": False}


def exit_deadline(on: bool = True) -> None:
    """Let `stop_deadline` end this process (the command line's, not a library caller's)."""
    _DEADLINE["on"] = bool(on)


def stop_deadline(code: int, line: str) -> None:
    """The stop is decided (`line`: what the run prints, exit `code`): when exit_deadline is on,
    a daemon timer ends the process with `code` after STOP_GRACE_S, saying `line` and that its
    cleanup was cut short, unless it has exited by then. Armed once."""
    if not _DEADLINE["on"] or _DEADLINE["armed"]:
        return
    _DEADLINE["armed"] = True

    def fire():
        try:
            sys.stderr.write(f"fastgrpo: {line} (its cleanup did not end within {STOP_GRACE_S:g} s: the process "
                             "ends now)\n")
            sys.stderr.flush()
        finally:
            os._exit(code)

    t = threading.Timer(STOP_GRACE_S, fire)
    t.daemon = True
    t.start()


def interrupted_line(signame: str, where: Optional[str]) -> str:
    """The one line of a run a signal stopped at once (the CLI prints it, `stop_deadline` too)."""
    return f"interrupted by {signame} {where or 'before any GRPO step finished; run the same command to resume'}"


def stop_at_once(signum: int, where: Optional[str]) -> RunInterrupted:
    """The RunInterrupted of a stop decided now, its deadline armed (`stop_deadline`)."""
    name = signal.Signals(signum).name
    stop_deadline(128 + int(signum), interrupted_line(name, where))
    return RunInterrupted(name, where)


@contextlib.contextmanager
def graceful_signals(request_stop: Optional[Callable[[int], None]] = None,
                     where: Optional[Callable[[], str]] = None) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    seen = {"n": 0}
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:  # a forked child (a `fork` pool's worker): the default action, not our stop
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        seen["n"] += 1
        if request_stop is None or seen["n"] > 1:
            for s, h in previous.items():
                signal.signal(s, h)
            raise stop_at_once(signum, where() if where is not None else None)
        request_stop(signum)

    for s in SIGNALS:
        signal.signal(s, handler)
    try:
        yield
    finally:
        if where is not None:  # what the run had done when it let go: the message of a signal after it
            with contextlib.suppress(Exception):
                _LAST_WHERE["where"] = where()
        for s, h in previous.items():
            signal.signal(s, h)


_LAST_WHERE = {"where": None}


def last_where() -> Optional[str]:
    """What the last run of this process said it had done when its signal handling ended (the
    pipeline's "after the run finished …"), or None: for a signal that lands after it."""
    return _LAST_WHERE["where"]
