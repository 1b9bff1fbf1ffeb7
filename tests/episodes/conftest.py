"""Shared pieces of the episode tests: the folder of the test tool and environment modules, and
a probe for processes that are still alive."""
import os
import time

import psutil
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def alive(pid: int) -> bool:
    """True when `pid` is a live process (a zombie is dead: it only waits for its reaper)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until(cond, timeout: float = 10.0) -> bool:
    """Poll `cond` every 5 ms until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture(scope="session")
def here():
    return HERE
