"""Parity with TRL 1.16: our packed loss equals GRPOTrainer._compute_loss, loss and gradients.

TRL's real `_compute_loss` (and its `_get_per_token_logps_and_entropies`, through the chunked
fused lm-head TRL patches into the model) runs on a minimal stand-in trainer object holding the
attributes it reads, with a tiny float64 Qwen2. Our side runs the same model's plain forward,
packs the completion tokens of the padded batch (ragged, padding dropped: the packed layout) and
calls `grpo_loss` with `trl_loss_config`. Loss and every parameter gradient must agree to 1e-6.
"""
import types
from collections import defaultdict

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from fastgrpo.advantages import broadcast_to_tokens  # noqa: E402
from fastgrpo.models.tiny import build_tiny_model  # noqa: E402
from fastgrpo.integrations.trl_config import trl_loss_config  # noqa: E402
from fastgrpo.loss import grpo_loss  # noqa: E402

from _trl_stand_in import GA, SPG, TAU, C, P, padded_batch  # noqa: E402
from _trl_stand_in import StandInAccelerator as _Accelerator  # noqa: E402


def _fake_trainer(model, loss_type, level, eps_high, delta, beta, bias_kl):
    args = types.SimpleNamespace(use_bias_correction_kl=bias_kl, delta=delta, steps_per_generation=SPG)
    fake = types.SimpleNamespace(
        model=model, args=args, loss_type=loss_type, importance_sampling_level=level, beta=beta,
        epsilon_low=0.2, epsilon_high=eps_high, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=True, vllm_importance_sampling_correction=True, current_gradient_accumulation_steps=GA,
        accelerator=_Accelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, max_completion_length=C,
    )
    get = trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies
    fake._get_per_token_logps_and_entropies = types.MethodType(getattr(get, "__wrapped__", get), fake)
    return fake


@pytest.fixture(scope="module")
def setup():
    model, tok = build_tiny_model("qwen2", seed=0, dtype=torch.float64, num_hidden_layers=1)
    model.train()
    add_fused_lm_head(model, temperature=TAU, outputs=("log_probs", "entropy"))
    inputs, lengths = padded_batch(model)
    return model, inputs, lengths


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _ours(model, inputs, lengths, spec):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=am).logits[:, P - 1:-1]  # [B, C, V] predicting completions
    on = inputs["completion_mask"].bool()
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    out = grpo_loss(logits[on], inputs["completion_ids"][on], broadcast_to_tokens(inputs["advantages"], cu),
                    old_logp=inputs["old_per_token_logps"][on], ref_logp=inputs["ref_per_token_logps"][on],
                    weights=inputs["importance_sampling_ratio"][on], cu_seqlens=cu, config=spec.config,
                    num_items=spec.num_items, impl="torch", return_entropy=True)
    return out.loss * spec.loss_scale, out


CASES = [
    # loss_type, importance level, eps_high, delta, beta, use_bias_correction_kl
    ("grpo", "token", 0.28, 1.5, 0.04, True),
    ("bnpo", "token", 0.28, 1.5, 0.04, True),
    ("dr_grpo", "token", 0.28, 1.5, 0.04, True),
    ("dapo", "token", 0.28, 1.5, 0.04, True),
    ("dapo", "token", 0.2, None, 0.1, False),
    ("grpo", "sequence", 0.28, 1.5, 0.04, True),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_matches_trl_compute_loss(setup, case):
    model, inputs, lengths = setup
    loss_type, level, eps_high, delta, beta, bias_kl = case
    fake = _fake_trainer(model, loss_type, level, eps_high, delta, beta, bias_kl)
    model.zero_grad()
    trl_loss = trl_grpo.GRPOTrainer._compute_loss(fake, model, inputs)
    trl_loss.backward()
    g_trl = _grads(model)

    spec = trl_loss_config(loss_type, epsilon=0.2, epsilon_high=eps_high, delta=delta, beta=beta,
                           use_bias_correction_kl=bias_kl, importance_sampling_level=level, temperature=TAU,
                           max_completion_length=C, num_items_in_batch=inputs["num_items_in_batch"],
                           gradient_accumulation_steps=GA, steps_per_generation=SPG)
    model.zero_grad()
    loss, out = _ours(model, inputs, lengths, spec)
    loss.backward()
    g_ours = _grads(model)

    loss, trl_loss = float(loss.detach()), float(trl_loss.detach())
    assert abs(loss - trl_loss) <= 1e-6, (loss, trl_loss)
    assert trl_loss != 0.0 and set(g_ours) == set(g_trl)
    for name, g in g_trl.items():
        err = float((g_ours[name] - g).abs().max())
        assert err <= 1e-6, f"grad {name}: max error {err:.3e}"
    m = {k: v[-1] for k, v in fake._metrics["train"].items()}
    assert out.metrics["entropy_mean"].item() == pytest.approx(m["entropy"], abs=1e-6)
    assert out.metrics["kl_mean"].item() == pytest.approx(m["kl"], abs=1e-5)
    if level == "token":  # TRL counts sequence-level clip metrics per sequence, we count per token
        assert out.metrics["clip_frac_low"].item() == pytest.approx(m["clip_ratio/low_mean"], abs=1e-6)
        assert out.metrics["clip_frac_high"].item() == pytest.approx(m["clip_ratio/high_mean"], abs=1e-6)


def test_the_batch_exercises_every_branch(setup):
    """Guards the parity test against a batch where a clip / δ branch never fires."""
    model, inputs, lengths = setup
    spec = trl_loss_config("bnpo", epsilon_high=0.28, delta=1.5, temperature=TAU)
    with torch.no_grad():
        _, out = _ours(model, inputs, lengths, spec)
    on = inputs["completion_mask"].bool()
    r = torch.exp(out.logp - inputs["old_per_token_logps"][on])
    a = broadcast_to_tokens(inputs["advantages"], torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    assert bool(((r > 1.28) & (a > 0)).any()), "no high clip"
    assert bool(((r < 0.8) & (a < 0)).any()), "no low clip"
    assert bool(((r > 1.5) & (a < 0)).any()), "no δ cap"
    assert bool(((r > 0.8) & (r < 1.28)).any()), "no unclipped token"
