"""The worker's side of an overlapped broadcast (sync.overlap): a generate call admitted under a
version still on its way starts only once that version is staged, and a version that never
arrives stops the call within sync.timeout naming the worker (no Ray: the plain class)."""
import threading

import pytest
import torch

from async_helpers import async_cfg


class _Engine:
    def __init__(self):
        self.model = torch.nn.Linear(2, 2)
        self.calls = []

    def generate(self, prompt_ids, n, sampling):
        from fastgrpo.rollout.base import Completion

        self.calls.append(float(self.model.weight.detach().sum()))
        return [[Completion(text="x", token_ids=[1], logprobs=[0.0], finish_reason="stop") for _ in range(n)] for _ in prompt_ids]


def _worker(tmp_path, timeout):
    from fastgrpo.workers.rollout_worker import RolloutWorker

    cfg = async_cfg(tmp_path, f"sync.timeout={timeout}")
    w = RolloutWorker(cfg, 0, lambda c, p: (_Engine(), "fake"))
    w._load_staged = lambda: _stage(w)  # the fake engine: staged weights are a version number only
    return w


def _stage(w):
    with w._lock:
        staged, w._staged = w._staged, None
    if staged is not None:
        w.version = staged[0]


def test_a_call_waits_for_the_version_it_was_admitted_under(tmp_path):
    from fastgrpo.rollout.base import SamplingConfig

    w = _worker(tmp_path, 60)
    w.set_version(0)
    out = {}
    t = threading.Thread(target=lambda: out.update(w.generate(1, [[1, 2]], 2, SamplingConfig(), min_version=1)))
    t.start()
    w.set_version(1)  # the broadcast of version 1 lands (before or while the call waits)
    t.join(60)
    assert not t.is_alive() and out["version"] == 1
    assert all(c.policy_version == 1 for g in out["groups"] for c in g)


def test_a_version_that_never_arrives_stops_the_call_naming_the_worker(tmp_path):
    from fastgrpo.rollout.base import SamplingConfig

    w = _worker(tmp_path, 0.05)
    w.set_version(3)
    with pytest.raises(RuntimeError, match=r"rollout worker 0: weights version 4 did not arrive within "
                                           r"sync.timeout=0.05 s \(it holds version 3\)"):
        w.generate(1, [[1, 2]], 2, SamplingConfig(), min_version=4)
