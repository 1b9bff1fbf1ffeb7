"""Hostile solutions: each must score 0 within timeout + 1 s and leave the host and this test
process untouched. Limits are small (2 s, 256 MB, 16 processes) so a failure cannot take the
shared machine down."""
import os
import socket
import time

import psutil
import pytest

from fastgrpo.rewards import SandboxLimits, code_reward

TIMEOUT = 2.0
LIMITS = SandboxLimits(memory_mb=256, nproc=16, max_output_bytes=1 << 20)
PASSING_TESTS = "assert add(1, 2) == 3"
ADD = "\ndef add(a, b):\n    return a + b\n"


def run_one(pool, code, tests=PASSING_TESTS):
    t0 = time.monotonic()
    scores, why = code_reward([code + ADD], [tests], timeout=TIMEOUT, pool=pool, limits=LIMITS, return_reasons=True)
    return scores[0], why[0], time.monotonic() - t0


@pytest.fixture
def check(pool, live_sandbox_processes):
    """Run a hostile solution: it must score 0 within timeout + 1 s, leave no sandbox process
    and keep the pool's workers; returns the reason code."""

    def run(code, tests=PASSING_TESTS):
        before = set(pool.worker_pids())
        score, why, elapsed = run_one(pool, code, tests)
        assert score == 0.0, (score, why)
        assert elapsed < TIMEOUT + 1.0, (elapsed, why)
        assert not live_sandbox_processes(), "sandbox processes survived the run"
        assert len(before) == len(pool.worker_pids())
        return why

    return run


def test_control_passes(pool):
    assert run_one(pool, "")[0] == 1.0


def test_infinite_loop(check):
    assert check("while True:\n    pass") == "timeout"


def test_fork_bomb(pool, check):
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    check(code)
    # every bomb process is gone, zombies included: the workers (subreapers) collected them
    left = [c.pid for w in pool.worker_pids() for c in psutil.Process(w).children(recursive=True)]
    assert not left, left


def test_fork_bomb_escaping_the_process_group(check):
    code = ("import os\nfor _ in range(8):\n    if os.fork() == 0:\n        os.setsid()\n"
            "        while True:\n            pass\nwhile True:\n    pass")
    check(code)


def test_memory_bomb(check):
    check("x = []\nwhile True:\n    x.append(bytearray(1 << 24))")


def test_write_outside_sandbox(check, tmp_path):
    target = tmp_path / "pwned.txt"
    repo_target = os.path.join(os.path.dirname(__file__), "pwned.txt")
    code = f"open({str(target)!r}, 'w').write('x')\nopen({repo_target!r}, 'w').write('x')"
    check(code)
    assert not target.exists() and not os.path.exists(repo_target)


def test_tmp_writes_vanish(pool):
    name = f"/tmp/fastgrpo-sbx-probe-{os.getpid()}"
    score, why, _ = run_one(pool, f"open({name!r}, 'w').write('x')")
    assert not os.path.exists(name)  # private tmpfs: the write (allowed there) never reaches the host


def test_socket_to_parent(check):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        check(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'x')")
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


def test_parent_environment_is_invisible(check, monkeypatch):
    secret = "fastgrpo-secret-7f3a9"
    monkeypatch.setenv("FASTGRPO_TEST_SECRET", secret)
    code = ("import os\nleak = repr(dict(os.environ))\n"
            f"for pid in (os.getppid(), {os.getpid()}, 1):\n"
            "    try:\n        leak += open(f'/proc/{pid}/environ', 'rb').read().decode('latin-1')\n"
            "    except OSError:\n        pass\n")
    tests = f"assert {secret!r} in leak"
    # control: the same code outside the sandbox does see it, so the test could fail
    ns = {}
    exec(code, ns)
    assert secret in ns["leak"]
    check(code, tests)


def test_ten_megabytes_of_stdout(check):
    assert check("import sys\nsys.stdout.write('x' * 10_000_000)\nsys.stdout.flush()") == "output_limit"


def test_kill_parent(check):
    code = f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({os.getpid()}, signal.SIGKILL)"
    check(code)
    assert psutil.Process().is_running()


def test_disk_filler_is_capped(check):
    check("for i in range(64):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))")


def test_cwd_is_private_and_writable(pool):
    code = "import os\nopen('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'\nCWD = os.getcwd()"
    assert run_one(pool, code, "assert add(1, 2) == 3\nassert os.access(CWD, os.W_OK)")[0] == 1.0


def _probe_writes(dirs):
    """Solution code that writes a probe file into each of `dirs`; RES maps dir → 'ok' or the error."""
    return ("import os\nRES = {}\n"
            f"for d in {list(dirs)!r}:\n"
            "    try:\n"
            "        with open(os.path.join(d, 'fastgrpo-probe'), 'w') as f:\n"
            "            f.write('x' * 4096)\n"
            "        RES[d] = 'ok'\n"
            "    except OSError as e:\n"
            "        RES[d] = e.strerror\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="private mounts need root (the unprivileged sandbox has none)")
def test_world_writable_dirs_are_private(tmp_path):
    """Every world-writable directory is found at start (here /run/lock and one made for this
    test, neither in a fixed list) and gets a private tmpfs: the write succeeds inside and never
    reaches the host. One deeper than the scan is read-only instead. The host stays writable."""
    from fastgrpo.rewards import RewardPool

    made = f"/var/fastgrpo-ww-{os.getpid()}"
    deep = os.path.join(made + "-deep", "a", "b", "c", "d")
    shallow = [d for d in ("/run/lock", made) if d == made or os.path.isdir(d)]
    try:
        os.makedirs(made)
        os.chmod(made, 0o1777)
        os.makedirs(deep)
        os.chmod(deep, 0o1777)
        with RewardPool(num_workers=1) as p:  # a fresh worker: it enumerates the view anew
            code = _probe_writes(shallow + [deep])
            tests = "".join(f"assert RES[{d!r}] == 'ok'\n" for d in shallow)
            tests += f"assert RES[{deep!r}] == 'Read-only file system', RES"
            scores, why = code_reward([code], [tests], pool=p, timeout=TIMEOUT, limits=LIMITS, return_reasons=True)
            assert scores == [1.0], why
        for d in shallow + [deep]:
            assert not os.path.exists(os.path.join(d, "fastgrpo-probe")), d
        assert not os.statvfs("/").f_flag & os.ST_RDONLY  # the remount stayed inside the sandbox
    finally:
        for d in shallow + [deep]:
            if os.path.exists(os.path.join(d, "fastgrpo-probe")):
                os.remove(os.path.join(d, "fastgrpo-probe"))
        import shutil

        shutil.rmtree(made, ignore_errors=True)
        shutil.rmtree(made + "-deep", ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="private mounts need root (the unprivileged sandbox has none)")
def test_sysv_shared_memory_dies_with_the_run(pool):
    """A SysV segment created by a run (not a file: no tmpfs covers it) lives in the run's own
    IPC namespace and is gone afterwards."""
    def segments():
        with open("/proc/sysvipc/shm") as f:
            return f.read().splitlines()[1:]

    before = segments()
    code = ("import ctypes\nlc = ctypes.CDLL(None, use_errno=True)\n"
            "SHM = lc.shmget(0x5eed, 1 << 20, 0o1666)\n")  # IPC_CREAT | 0666
    scores, why = code_reward([code], ["assert SHM >= 0"], pool=pool, timeout=TIMEOUT, limits=LIMITS,
                              return_reasons=True)
    assert scores == [1.0], why
    assert segments() == before
