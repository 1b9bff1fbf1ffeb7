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
