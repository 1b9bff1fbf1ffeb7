"""fastgrpo.rewards.sandbox: the processes rewards run in.

`procs`: process plumbing both need (libc, killing a uid's processes, reaping children);
`pool`: the verifier process pool with per-item timeouts; `runner`: the isolated Python
interpreter that runs untrusted code against unit tests; `judge`: the harness inside it (the
tests in one process, the solution in another); `mounts`: the read-only, private file-system view.
"""
from fastgrpo.rewards.sandbox.pool import RewardPool, TaskResult, default_pool
from fastgrpo.rewards.sandbox.runner import SandboxLimits, isolation_level, run_python

__all__ = ["RewardPool", "SandboxLimits", "TaskResult", "default_pool", "isolation_level", "run_python"]
