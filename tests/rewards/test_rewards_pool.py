import os
import queue
import time

import psutil
import pytest

from fastgrpo.rewards import RewardPool


def test_timeout_kills_and_replaces_worker(pool):
    before = pool.worker_pids()
    t0 = time.monotonic()
    res = pool.map(time.sleep, [(30,), (0.01,)], timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    assert res[0].reason == "timeout" and not res[0].ok
    assert res[1].ok
    after = pool.worker_pids()
    assert len(after) == 2 and set(after) != set(before)
    assert not [p for p in set(before) - set(after) if psutil.pid_exists(p)]


def test_worker_crash_is_a_result_not_an_exception(pool):
    res = pool.map(os._exit, [(3,)], timeout=5.0)
    assert res[0].reason == "worker_crash"
    assert pool.map(abs, [(-2,)], timeout=5.0)[0].value == 2


def test_exception_in_task_is_a_reason(pool):
    res = pool.map(int, [("not a number",)], timeout=5.0)
    assert res[0].reason == "error:ValueError"


def test_repeated_calls_keep_order(pool):
    for _ in range(3):
        res = pool.map(abs, [(-i,) for i in range(50)], timeout=5.0)
        assert [r.value for r in res] == list(range(50))


def test_bounded_queue_and_clean_close():
    p = RewardPool(num_workers=1, max_pending=2)
    pids = p.worker_pids()
    try:
        first = p.submit(time.sleep, (2.0,), timeout=10.0)
        time.sleep(0.3)  # the worker has taken it
        queued = [p.submit(time.sleep, (0,), timeout=10.0, block_timeout=0.5) for _ in range(2)]
        with pytest.raises(queue.Full):
            p.submit(time.sleep, (0,), timeout=10.0, block_timeout=0.2)
    finally:
        t0 = time.monotonic()
        p.close()
        assert time.monotonic() - t0 < 3.0
    assert first.result().reason == "closed"
    assert [f.result().reason for f in queued] == ["closed", "closed"]
    assert not [pid for pid in pids if psutil.pid_exists(pid)]
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(abs, (1,), timeout=1.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=0)
    with pytest.raises(ValueError, match="context"):
        RewardPool(num_workers=1, context="threads")


def test_worker_killed_while_idle_is_replaced(pool):
    victim = pool.worker_pids()[0]
    os.kill(victim, 9)
    time.sleep(0.1)
    res = pool.map(abs, [(-i,) for i in range(6)], timeout=5.0)
    assert [r.value for r in res] == list(range(6))
    assert victim not in pool.worker_pids() and len(pool.worker_pids()) == 2


def test_forked_copy_refuses_work_and_does_not_stop_parent_workers(pool):
    pid = os.fork()
    if pid == 0:  # child: a copy of the pool without its dispatcher thread
        code = 1
        try:
            pool.submit(abs, (1,), timeout=1.0)
        except RuntimeError:
            pool.close()
            code = 0
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool.map(abs, [(-5,)], timeout=5.0)[0].value == 5
