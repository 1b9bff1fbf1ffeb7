"""A training step's logged loss metrics equal what the loss computed, and a sequence longer
than the packing budget trains in a micro-batch of its own instead of failing the step."""
import torch
from trainer_helpers import NoisyTask

import fastgrpo.loss as loss_mod
from fastgrpo.trainer import Trainer


def test_logged_entropy_is_the_masked_mean_of_the_loss_entropies(cfg_factory, monkeypatch):
    seen = []
    real = loss_mod.grpo_loss

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.append((out.entropy.detach().double(), kw["mask"].double()))
        return out

    monkeypatch.setattr(loss_mod, "grpo_loss", spy)
    t = Trainer(cfg_factory("steps=1"), task=NoisyTask(), log=lambda m: None)
    logs = t.step()
    t.close()
    assert seen, "the update ran no loss"
    ent = sum(float((e * m).sum()) for e, m in seen) / sum(float(m.sum()) for _, m in seen)
    assert abs(logs["loss/entropy_mean"] - ent) < 1e-4 * max(1.0, ent), (logs["loss/entropy_mean"], ent)


def test_sequence_over_the_packing_budget_gets_its_own_micro_batch(cfg_factory):
    # prompts of ~6 tokens + up to 8 new tokens against a budget of 6: every sequence is oversize
    t = Trainer(cfg_factory("steps=1", "packing.max_tokens=6"), task=NoisyTask(), log=lambda m: None)
    before = {k: v.clone() for k, v in t.backend.module.state_dict().items()}
    logs = t.step()
    t.close()
    assert "train/skipped" not in logs
    changed = any(not torch.equal(v, before[k]) for k, v in t.backend.module.state_dict().items())
    assert changed or logs.get("train/no_update") == 1.0
