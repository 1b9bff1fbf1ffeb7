"""The sync paths with vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1):
the shared-memory buckets are mapped by name in the worker process and only metadata crosses
vLLM's msgpack RPC; the per-parameter baseline sends tensors by value. Outputs after each sync
equal the trainer's (up to a float64 tie, see rollout_oracle)."""
import os

import pytest
import torch

import vllm  # noqa: F401

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import SamplingConfig, make_engine
from fastgrpo.rollout.torch_engine import TorchEngine
from rollout_oracle import check_greedy_pair, check_rollouts, float64_copy

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

PROMPTS = ["1+2=", "(7+8)*9=", "a"]
GREEDY = SamplingConfig(temperature=0, max_new_tokens=8)


@pytest.fixture(scope="module")
def engine():
    model, tok = build_tiny_model("qwen2", seed=6, head_dim=32, num_attention_heads=2)
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        eng = make_engine("vllm", model, tok, max_model_len=128, max_num_seqs=8, kv_cache_bytes=32 << 20,
                          bucket_bytes=2048)
    finally:
        if old is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
    yield model, tok, eng
    eng.close()


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


def _greedy(engine):
    return [g[0].token_ids for g in engine.generate(PROMPTS, 1, GREEDY)]


def test_engine_runs_in_another_process(engine):
    assert engine[2].in_process is False


@pytest.mark.parametrize("path", ["bucketed", "per_parameter"])
def test_sync_across_processes(engine, path):
    model, tok, eng = engine
    before = _greedy(eng)
    _perturb(model, 1 if path == "bucketed" else 2)
    stats = eng.update_weights(model) if path == "bucketed" else eng.sync_per_parameter(model)
    assert stats.nbytes == sum(p.numel() * 4 for p in model.parameters())
    out = eng.generate(PROMPTS, 1, GREEDY)
    after = [g[0].token_ids for g in out]
    # the trainer's greedy output, up to a tie float64 puts within float32 rounding (vLLM's CPU
    # kernels round otherwise than ours); each token float64's argmax up to it
    exact = float64_copy(model)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    check_rollouts("vllm greedy", model, ids, [g[0] for g in out], temperature=0, model64=exact)
    trainer = [g[0].token_ids for g in TorchEngine(model, tok).generate(PROMPTS, 1, GREEDY)]
    for p, i, a, b in zip(PROMPTS, ids, after, trainer):
        check_greedy_pair(p, exact, i, a, b)
    assert after != before
