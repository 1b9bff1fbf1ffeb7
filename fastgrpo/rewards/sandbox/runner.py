"""Run untrusted Python (model-written code + hidden tests) in a sandboxed child process.

Follows the layered design of competitive-programming judges and of the RL code sandboxes
(DeepSeek-R1 / verl "sandbox fusion", OpenAI's human-eval `reliability_guard`), but enforced by
the kernel instead of by monkey-patching `os` inside the child:

- a separate process in a new session (its own process group) started from a pool worker, so
  `preexec_fn` runs in a single-threaded parent;
- rlimits: CPU seconds, address space, file size, open files, process count (RLIMIT_NPROC is
  ignored for root, so the child drops to a unique unprivileged uid, SANDBOX_UID_BASE + worker
  pid, which makes the process cap real and lets us kill every process of that uid afterwards,
  even ones that called setsid() to leave the process group);
- no network: the pool worker sits in a new empty network namespace (see pool.py);
- private mount and IPC namespaces (mounts.py): every real file system is remounted read-only
  and each world-writable directory of the view (enumerated by a walk at start: /tmp, /var/tmp,
  /dev/shm, /run/lock ... whatever this host has) gets a fresh size-capped tmpfs, so writes
  vanish with the run; SysV shared memory and message queues die with the IPC namespace; the
  cwd is a fresh directory in the private /tmp owned by the sandbox uid (without root: a fresh
  host temporary directory);
- a scrubbed environment (PATH, HOME, LANG only) and `python -I` (no PYTHON* variables, no user
  site); /proc/<pid>/environ of root processes is unreadable to the sandbox uid;
- a wall-clock timeout and capped output (reading stops at `max_output_bytes`: the run fails);
- the tests run in a judge process apart from the solution (judge.py): the solution's process
  never holds the tests, the verdict pipe or its per-run nonce, and results reach the judge only
  as plain data, so patching builtins, forging `__eq__`, reading frames or gc, printing fake
  verdicts or exiting early cannot raise a score.

Departures / limits: no seccomp filter; files outside the tmpfs mounts stay readable where they
are world-readable; a world-writable directory deeper than the enumeration walk (four levels
below a mount point) is read-only rather than private, and a mount that refuses the read-only
remount (some FUSE file systems) stays as writable as it was for the sandbox uid; the judge and
the solution share the sandbox uid, so the solution can kill or stop the judge (that scores 0:
no verdict) but not read or write its memory (the judge is non-dumpable). `isolation_level()`
reports what is actually in force. Without root the sandbox keeps the network namespace (inside
an unprivileged user namespace), rlimits, the process group, the scrubbed env and the judge,
but has no uid, mounts or IPC namespace of its own: RLIMIT_NPROC then counts all of the user's
processes, a child that leaves the process group survives the kill, /tmp and every file the
user may write are the host's (so a solution could also plant code that later runs as that
user). Bubblewrap is not used: as root the namespaces above are set up directly, and without
root it would rely on the same unprivileged user namespaces.
"""
from __future__ import annotations

import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

from fastgrpo.rewards.sandbox import judge
from fastgrpo.rewards.sandbox.mounts import apply_view, view_plan
from fastgrpo.rewards.sandbox.procs import PR_SET_PDEATHSIG, WORKER_STATE, kill_uid, libc, reap_children

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_REC, MS_PRIVATE = 16384, 1 << 18

# The harness (judge.py) reads one JSON job from stdin, runs the solution in a forked host
# process and the tests itself, and writes "<nonce> T <i> <0|1>" per assert and
# "<nonce> DONE <passed> <total> <errors>" to the verdict pipe (its fd number comes in the job).
# Compiling its source costs ~5 ms a run (a sixth of a run), so each interpreter compiles it once
# (in a trusted call, outside the sandbox) and every run gets the marshalled code object.
_JUDGE_ARGV: dict = {}
_COMPILE = ("import marshal, sys; sys.stdout.write(marshal.dumps(compile(sys.stdin.read(), 'judge.py', 'exec')).hex())")


def _judge_argv(python: str) -> list:
    if python not in _JUDGE_ARGV:
        path = os.path.abspath(judge.__file__)
        with open(path[:-1] if path.endswith(".pyc") else path, encoding="utf-8") as f:
            source = f.read()
        argv = [python, "-I", "-c", source]
        try:
            code = subprocess.run([python, "-I", "-c", _COMPILE], input=source, capture_output=True, text=True,
                                  timeout=30, check=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}).stdout
            if code and len(code) < 100_000:  # one argv string is capped at 128 KiB (MAX_ARG_STRLEN)
                argv = [python, "-I", "-c", f"import marshal; exec(marshal.loads(bytes.fromhex({code!r})))"]
        except (OSError, subprocess.SubprocessError):
            pass  # the source itself works everywhere; only slower
        _JUDGE_ARGV[python] = argv
    return _JUDGE_ARGV[python]


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5  # RLIMIT_CPU; the wall clock timeout is enforced separately
    memory_mb: int = 512  # RLIMIT_AS; Python itself needs ~30 MB of address space
    file_size_mb: int = 16  # RLIMIT_FSIZE per written file
    nproc: int = 32  # RLIMIT_NPROC for the sandbox uid (threads count too)
    nofile: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # stdout+stderr read before the run is failed
    tmpfs_mb: int = 16  # size of each private tmpfs (/tmp, the working dir, /var/tmp, /dev/shm)
    python: Optional[str] = None  # interpreter to run; None: this one if the sandbox uid may
    # execute it, else a world-executable system python3 (standard library only)


@dataclass
class SandboxResult:
    passed: int  # asserts that held
    total: int  # top-level asserts in the tests
    errors: int  # other top-level test statements that raised (e.g. HumanEval's `check(f)`)
    done: bool  # the harness reached the end of the tests
    reason: Optional[str]  # None when done, else timeout / output_limit / crashed / solution_error
    seconds: float
    output: bytes


def _world_executable(path: str) -> bool:
    """True when an unprivileged uid can execute `path`: the file and every directory above it
    carry the 'other' execute bit (a pyenv interpreter under /root, mode 0700, does not)."""
    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & 0o001:
            return False
        d = os.path.dirname(path)
        while True:
            if not os.stat(d).st_mode & 0o001:
                return False
            if d == "/":
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


_PYTHON: dict = {}


def sandbox_python(drop_privileges: bool) -> Optional[str]:
    """The interpreter the sandbox runs: this process's own when the sandbox uid can execute it,
    otherwise the first world-executable python3 on the system path (standard library only)."""
    if drop_privileges not in _PYTHON:
        if not drop_privileges:
            _PYTHON[drop_privileges] = sys.executable
        else:
            cands = [sys.executable] + [os.path.join(d, "python3") for d in ("/usr/bin", "/usr/local/bin", "/bin")]
            _PYTHON[drop_privileges] = next((c for c in cands if os.path.exists(c) and _world_executable(c)), None)
    return _PYTHON[drop_privileges]


def isolation_level() -> str:
    """What the sandbox enforces in this process, e.g.
    'netns+mountns+rofs+ipcns+setuid+rlimits+pgroup'."""
    parts = []
    if WORKER_STATE.get("netns"):
        parts.append("netns" if WORKER_STATE.get("root") else "userns+netns")
    if WORKER_STATE.get("root"):
        parts += ["mountns", "rofs", "ipcns", "setuid"]
    parts += ["rlimits", "pgroup"]
    return "+".join(parts)


def _preexec(limits: SandboxLimits, uid: Optional[int], home: str, view=None):
    import resource

    def apply():
        os.setsid()
        if uid is not None:
            lc = libc()
            # Private mount and IPC namespaces (SysV shm / message queues of a run die with it);
            # refuse to mount anything unless propagation is private, otherwise the mounts
            # would reach the whole host.
            if ((lc.unshare(CLONE_NEWNS | CLONE_NEWIPC) == 0 or lc.unshare(CLONE_NEWNS) == 0)
                    and lc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0):
                # every real file system read-only, a private tmpfs over each world-writable
                # directory (mounts.py): nothing the run writes outlives it
                private, _ = apply_view(lc, view, limits.tmpfs_mb)
                if b"/tmp" in private:
                    # The working directory moves into the fresh /tmp: what the run writes is
                    # capped at tmpfs_mb in memory and never touches the host's disk.
                    os.mkdir(home, 0o700)
                    os.chown(home, uid, uid)
                    os.chdir(home)
        mb = 1 << 20
        for res, val in ((resource.RLIMIT_CPU, limits.cpu_seconds), (resource.RLIMIT_AS, limits.memory_mb * mb),
                         (resource.RLIMIT_FSIZE, limits.file_size_mb * mb), (resource.RLIMIT_NOFILE, limits.nofile),
                         (resource.RLIMIT_NPROC, limits.nproc), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (val, val))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            # set after the uid change: changing credentials clears the parent-death signal
            libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return apply


def _kill_all(proc: subprocess.Popen, uid: Optional[int]):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        kill_uid(uid)
    proc.wait()


def run_python(code: str, tests: str, timeout: float = 5.0, limits: Optional[SandboxLimits] = None,
               stop_on_setup_error: bool = True) -> SandboxResult:
    """Execute `code` then `tests` in a fresh sandboxed Python; never raises for bad code."""
    limits = limits or SandboxLimits()
    import json

    uid = WORKER_STATE.get("sandbox_uid") if WORKER_STATE.get("root") else None
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="fastgrpo-sbx-")
    r_fd, w_fd = os.pipe()
    job = json.dumps({"nonce": nonce, "fd": w_fd, "code": code, "tests": tests,
                      "stop_on_setup_error": stop_on_setup_error}).encode("utf-8", "surrogatepass")
    t0 = time.monotonic()
    proc = None
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        home = os.path.join("/tmp", os.path.basename(workdir)) if uid is not None else workdir
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        python = limits.python or sandbox_python(uid is not None)
        if python is None:
            return SandboxResult(0, 0, 0, False, "sandbox_error:no_python", 0.0, b"")
        proc = subprocess.Popen(_judge_argv(python), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir, env=env,
                                pass_fds=(w_fd,), close_fds=True,
                                preexec_fn=_preexec(limits, uid, home, view_plan() if uid is not None else None))
        os.close(w_fd)
        w_fd = -1
        return _collect(proc, job, r_fd, nonce, timeout, limits, uid, t0)
    except OSError as e:
        return SandboxResult(0, 0, 0, False, f"sandbox_error:{type(e).__name__}", time.monotonic() - t0, b"")
    finally:
        if proc is not None and proc.poll() is None:
            _kill_all(proc, uid)
        elif uid is not None:
            kill_uid(uid)  # background children of a finished run
        if uid is not None:
            reap_children()
        for fd in (r_fd, w_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc, job: bytes, r_fd: int, nonce: str, timeout: float, limits: SandboxLimits,
             uid: Optional[int], t0: float) -> SandboxResult:
    sel = selectors.DefaultSelector()
    out_fd = proc.stdout.fileno()
    in_fd = proc.stdin.fileno()
    for fd in (out_fd, r_fd, in_fd):
        os.set_blocking(fd, False)
    sel.register(out_fd, selectors.EVENT_READ)
    sel.register(r_fd, selectors.EVENT_READ)
    sel.register(in_fd, selectors.EVENT_WRITE)
    output, verdict, to_send = bytearray(), bytearray(), memoryview(job)
    open_fds = {out_fd, r_fd}
    reason = None
    deadline = t0 + timeout
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        for key, _ in sel.select(timeout=left):
            fd = key.fd
            if fd == in_fd:
                try:
                    to_send = to_send[os.write(in_fd, to_send[:65536]):]
                except BlockingIOError:  # pipe full: the harness reads it, try again
                    continue
                except BrokenPipeError:  # the child died before reading its job
                    to_send = to_send[:0]
                if not len(to_send):
                    sel.unregister(in_fd)
                    proc.stdin.close()
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(fd)
                open_fds.discard(fd)
            elif fd == out_fd:
                output += chunk
                if len(output) > limits.max_output_bytes:
                    reason = "output_limit"
            else:
                verdict += chunk
                if len(verdict) > 1 << 16:  # the harness writes a few bytes per test
                    reason = "output_limit"
        if reason:
            break
        if proc.poll() is not None:
            # The harness has exited: a background child still holding the pipes must not
            # turn a finished run into a timeout.
            if nonce.encode() + b" DONE " in verdict:
                break
            deadline = min(deadline, time.monotonic() + 0.2)
    sel.close()
    if reason:
        _kill_all(proc, uid)
    else:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            reason = "timeout"
            _kill_all(proc, uid)
    if not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass
    proc.stdout.close()
    passed = total = errors = 0
    done = False
    for line in bytes(verdict).decode("ascii", "replace").splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[0] != nonce:
            continue  # something else wrote on the verdict pipe: ignore it
        if parts[1] == "T" and len(parts) == 4:
            passed += parts[3] == "1"
        elif parts[1] == "DONE" and len(parts) == 5:
            done, passed, total, errors = True, int(parts[2]), int(parts[3]), int(parts[4])
    if reason is None and not done:
        reason = "solution_error" if proc.returncode == 1 else "crashed"
    return SandboxResult(passed, total, errors, done and reason is None, reason, time.monotonic() - t0,
                         bytes(output[: limits.max_output_bytes]))
