"""One RewardPool for the reward tests (2 workers, as on the target machines): created once,
closed at the end, and the end checks that no worker or sandbox process is left behind."""
import os

import psutil
import pytest

from fastgrpo.rewards import RewardPool
from fastgrpo.rewards.sandbox.pool import SANDBOX_UID_BASE


def sandbox_processes():
    """Live processes owned by any sandbox uid (should be none between runs; a zombie holds
    no memory or CPU and is collected by its reaper)."""
    out = []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            if (p.info["uids"] and p.info["uids"].real >= SANDBOX_UID_BASE
                    and p.info["status"] != psutil.STATUS_ZOMBIE):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


@pytest.fixture(scope="session")
def live_sandbox_processes():
    """The `sandbox_processes` probe, as a fixture (test modules do not import conftest)."""
    return sandbox_processes


@pytest.fixture(scope="session")
def pool():
    p = RewardPool(num_workers=2)
    pids = p.worker_pids()
    yield p
    p.close()
    alive = [pid for pid in pids if psutil.pid_exists(pid)]
    assert not alive, f"pool workers left after close: {alive}"
    assert not sandbox_processes(), f"sandbox processes left: {sandbox_processes()}"
    assert os.getpid() == psutil.Process().pid
