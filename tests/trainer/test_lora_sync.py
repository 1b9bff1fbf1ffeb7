"""The engine samples from the trained LoRA policy (issue 24): after each of several updates the
engine's completions and their log-probs are those of the trainer's adapted model, checked against
its float64 copy with the rollout oracle (tests/rollout/rollout_oracle.py: tokens as float64's
draws of the same uniforms, log-prob rms error within the float32 bound). An adapter that never
reaches the engine (a decode path reading the base weights) fails it: the adapter is made large
enough that the base's log-probs are far outside that bound, which the test also asserts."""
import os
import sys

import pytest
import torch

from trainer_helpers import NoisyTask, tiny_cfg

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "rollout"))
from rollout_oracle import check_engine, float64_copy, teacher_forced_logits  # noqa: E402

from fastgrpo.models import lora  # noqa: E402
from fastgrpo.rollout import SamplingConfig  # noqa: E402
from fastgrpo.rollout.torch_engine import TorchEngine  # noqa: E402
from fastgrpo.trainer.build import build_model  # noqa: E402
from fastgrpo.trainer.grpo import Trainer  # noqa: E402

PROMPTS = ["1+2=", "12*3-5=", "(7+8)*9="]


def _logp(model, prompt, toks, tau):
    z = teacher_forced_logits(model, prompt, toks).double() / tau
    return (z.gather(-1, torch.tensor(toks)[:, None])[:, 0] - z.logsumexp(-1))


@pytest.mark.parametrize("decoder", ["auto", "lean", "hf"])
def test_builtin_engine_samples_from_the_trained_lora_policy(tmp_path, decoder):
    cfg = tiny_cfg(tmp_path, "model.lora.rank=4", "optimizer.lr=2e-2", "model.hidden_size=64",
                   "model.intermediate_size=128")
    model, tok = build_model(cfg.model)
    with torch.no_grad():  # a trained-looking adapter from the start: B = 0 would hide a missing one
        gen = torch.Generator().manual_seed(11)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    engine = TorchEngine(model, tok, decoder=decoder)
    t = Trainer(cfg, model, tok, task=NoisyTask(), engine=engine, log=lambda *a: None)
    assert t.engine.model is model  # shares the module: nothing to send, the adapter is there
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    sp = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=3)
    before = {k: v.clone() for k, v in lora.adapter_named_tensors(model).items()}
    for step in range(3):
        t.step()
        out = t.engine.generate(ids, 2, sp)
        m64 = float64_copy(model)
        check_engine(f"lora {decoder} after update {step + 1}", model, tok, ids, out, sp, model64=m64)
        # not vacuous: the base alone gives these completions clearly other log-probs
        flat = [(ids[i], c) for i, g in enumerate(out) for c in g if c.token_ids]
        with lora.adapter_disabled(m64):
            far = max(float((_logp(m64, p, c.token_ids, 1.0) - torch.tensor(c.logprobs, dtype=torch.float64))
                            .abs().max()) for p, c in flat)
        assert far > 0.05, "the adapter barely changes the policy: the test could not see a missing adapter"
    after = lora.adapter_named_tensors(model)
    assert any(not torch.equal(before[k], after[k]) for k in after), "no update reached the adapter"
    t.close()


def test_adapter_named_tensors_are_the_live_adapter_and_small(tmp_path):
    """What the async workers' broadcast will carry under LoRA: the adapter's tensors by name, the
    trainer's own storage (no copy), a small fraction of the model."""
    cfg = tiny_cfg(tmp_path, "model.lora.rank=2")
    model, _ = build_model(cfg.model)
    named = lora.adapter_named_tensors(model)
    live = {p.data_ptr() for n, p in model.named_parameters() if ".lora_" in n}
    assert named and {t.data_ptr() for t in named.values()} == live
    assert all(".lora_A." in k or ".lora_B." in k for k in named)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert lora.adapter_bytes(model) < 0.2 * total


def test_an_adapter_the_lean_steps_cannot_fold_falls_back_once(tmp_path):
    """A DoRA adapter (its magnitude vector: not W + s·B A): the lean / native decode steps step
    aside with one warning, and the engine samples what PEFT's own layers compute."""
    import warnings

    from peft import LoraConfig, get_peft_model

    from fastgrpo.models.tiny import build_tiny_model
    from fastgrpo.rollout.decoders import LeanStepper

    model, tok = build_tiny_model("qwen2", seed=2, head_dim=32, num_attention_heads=2)
    get_peft_model(model, LoraConfig(r=2, use_dora=True, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    lora._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="DoRA"):
        assert not LeanStepper.supports(model)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    sp = SamplingConfig(temperature=1.0, max_new_tokens=6, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        out = TorchEngine(model, tok, decoder="auto").generate(ids, 2, sp)
    check_engine("dora fallback", model, tok, ids, out, sp)
