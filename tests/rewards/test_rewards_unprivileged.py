"""The sandbox without root: run a pool as an unprivileged user (uid 65534 via setpriv when
these tests run as root, as they do on the project machines; directly otherwise). Isolation
then comes from an unprivileged user + network namespace, rlimits and the process group."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import socket, sys, time
from fastgrpo.rewards import RewardPool, code_reward
if __name__ == "__main__":
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1); port = srv.getsockname()[1]
    with RewardPool(num_workers=1, preload=(), memory_limit_mb=None) as pool:
        print("LEVEL", pool.isolation_level())
        ok = code_reward(["def add(a, b): return a + b"], ["assert add(1, 2) == 3"], pool=pool)
        net = code_reward([f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"],
                          ["assert True"], pool=pool)
        t0 = time.monotonic()
        loop = code_reward(["while True: pass"], ["assert True"], pool=pool, timeout=1.0)
        print("SCORES", ok, net, loop, round(time.monotonic() - t0, 2))
"""


def _python_for_nobody():
    if os.geteuid() != 0:
        return [sys.executable]
    # the venv interpreter may sit under /root (mode 0700): use a world-executable python3
    from fastgrpo.rewards.sandbox.runner import sandbox_python

    return [shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups", "--",
            sandbox_python(True)]


def test_sandbox_as_unprivileged_user():
    cmd = _python_for_nobody() + ["-c", SCRIPT]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/",
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    level = next(line for line in out.stdout.splitlines() if line.startswith("LEVEL"))
    assert "userns+netns" in level and "setuid" not in level, level
    scores = next(line for line in out.stdout.splitlines() if line.startswith("SCORES")).split()
    assert scores[1:4] == ["[1.0]", "[0.0]", "[0.0]"], out.stdout
    assert float(scores[4]) < 2.0
