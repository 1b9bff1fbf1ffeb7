"""benchmarks/bench_lora.py in --smoke mode (the tiny model, 2 steps): every row runs in its own
process and reports memory, phase times, sync bytes and held-out accuracy; LoRA's sync is its
adapter alone. The GPU LoRA recipe loads with the config loader."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_lora_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    from benchmarks import bench_lora

    rows = bench_lora.main(["--smoke", "--methods", "full", "lora-1", "--out", str(tmp_path)])
    by = {r["method"]: r for r in rows}
    assert set(by) == {"full", "lora-1"}
    for r in rows:
        assert r["peak_mb"] > 0 and r["timing/step"] > 0 and r["timing/update"] > 0 and "acc_after" in r
    assert by["lora-1"]["trainable"] < by["full"]["trainable"] / 10
    assert by["lora-1"]["sync_bytes"] == 4 * by["lora-1"]["trainable"]  # the adapter alone crosses
    assert by["full"]["sync_bytes"] >= 4 * by["full"]["trainable"]
    assert "| lora-1 |" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "results.json")


def test_gpu_lora_recipe_loads():
    from fastgrpo.config import load_config

    cfg = load_config(os.path.join(ROOT, "examples", "gpu", "qwen2.5-7b-lora-gsm8k.yaml"))
    assert cfg.model.lora.rank == 32 and cfg.model.lora.sync == "adapter" and cfg.rollout.engine == "vllm"
    assert cfg.algorithm.beta > 0  # the reference comes free (the base with the adapter off)
