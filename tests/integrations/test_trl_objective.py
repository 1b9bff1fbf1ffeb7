"""The TRL drop-in off the fused loss contract: loss types cispo, sapo, luspo, vespo, the entropy
bonus (static and adaptive), `top_entropy_quantile`, `off_policy_mask_threshold`, the MoE
auxiliary loss and soft-capped / scaled logits run TRL's O(B·T) objective on fastgrpo's fused
head. On the same float64 batch, loss, every parameter gradient, the logged metrics and the
adaptive-entropy state equal TRL 1.16's own `_compute_loss` (≤ 1e-6); the fused head itself is
checked against autograd on explicit logits; the per-run path counters and their metrics.
"""
import dataclasses
import types
from collections import defaultdict

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from trl import GRPOConfig  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from fastgrpo.integrations.trl import FastGRPOStats, _install_forward, fastgrpo_compute_loss  # noqa: E402
from fastgrpo.integrations.trl_head import fused_head_logprobs  # noqa: E402
from fastgrpo.models.tiny import build_tiny_model  # noqa: E402

from _trl_stand_in import GA, SPG, TAU, C, padded_batch  # noqa: E402
from _trl_stand_in import StandInAccelerator  # noqa: E402

TOL = 1e-6
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}


class _Accelerator(StandInAccelerator):
    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _stand_in(model, loss_type="grpo", level="token", **opts):
    """The attributes of a GRPOTrainer that `_compute_loss` reads (GRPOConfig defaults + opts)."""
    args = types.SimpleNamespace(**{**_DEFAULTS, "steps_per_generation": SPG, "delta": opts.pop("delta", None),
                                    "entropy_target": opts.pop("entropy_target", _DEFAULTS["entropy_target"])})
    G = trl_grpo.GRPOTrainer
    t = types.SimpleNamespace(
        model=model, args=args, loss_type=loss_type, importance_sampling_level=level, beta=opts.pop("beta", 0.04),
        epsilon_low=0.2, epsilon_high=opts.pop("epsilon_high", 0.28),
        top_entropy_quantile=opts.pop("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=opts.pop("off_policy_mask_threshold", None),
        use_vllm=True, vllm_importance_sampling_correction=True, current_gradient_accumulation_steps=GA,
        accelerator=_Accelerator(), temperature=TAU, max_completion_length=C,
        entropy_coef=opts.pop("entropy_coef", 0.0), use_adaptive_entropy=opts.pop("use_adaptive_entropy", False),
        _last_world_entropy=opts.pop("last_world_entropy", float("inf")), _entropy_window_stats=None,
        router_aux_loss_coef=opts.pop("router_aux_loss_coef", 0.0),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_off_policy_mask=G.get_off_policy_mask, get_gamma_weights=G.get_gamma_weights,
    )
    assert not opts, opts
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t.aux_loss_enabled = t.router_aux_loss_coef != 0.0
    t.get_high_entropy_mask = types.MethodType(G.get_high_entropy_mask, t)
    get = G._get_per_token_logps_and_entropies
    t._get_per_token_logps_and_entropies = types.MethodType(getattr(get, "__wrapped__", get), t)
    t._trl_compute_loss = types.MethodType(G._compute_loss, t)
    return t


def _prepared(model):
    model.train()
    add_fused_lm_head(model, temperature=TAU, outputs=("log_probs", "entropy"))  # as GRPOTrainer does
    _install_forward(model)
    inputs, _ = padded_batch(model)
    return model, inputs


@pytest.fixture(scope="module")
def qwen2():
    return _prepared(build_tiny_model("qwen2", seed=0, dtype=torch.float64, num_hidden_layers=1)[0])


@pytest.fixture(scope="module")
def capped():
    """Gemma-style soft-capped logits (and a logit scale) on the tiny Qwen2: TRL's fused head
    reads both from the config, so this exercises exactly the transform it applies."""
    model = build_tiny_model("qwen2", seed=1, dtype=torch.float64, num_hidden_layers=1)[0]
    model.config.final_logit_softcapping = 2.5
    model.config.logit_scale = 1.7
    return _prepared(model)


@pytest.fixture(scope="module")
def moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         shared_expert_intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                         router_aux_loss_coef=0.02, max_position_embeddings=64)
    cfg._experts_implementation = "eager"  # grouped_mm has no float64
    return _prepared(Qwen2MoeForCausalLM(cfg).to(torch.float64))


def _run(fn, model, inputs):
    model.zero_grad()
    loss = fn(model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(model, inputs, loss_type="grpo", level="token", **opts):
    """Loss, gradients, metrics and entropy-controller state: ours vs TRL's. Returns the errors."""
    trl_t, ours_t = _stand_in(model, loss_type, level, **opts), _stand_in(model, loss_type, level, **opts)
    trl_loss, g_trl = _run(trl_t._trl_compute_loss, model, inputs)
    loss, g = _run(lambda m, x: fastgrpo_compute_loss(ours_t, m, x), model, inputs)
    stats = ours_t.fastgrpo_stats
    assert stats.computed == 1 and stats.fused == 0 and not stats.fallback, stats.summary()
    assert float(trl_loss) != 0.0
    loss_err = abs(float(loss) - float(trl_loss))
    assert set(g) == set(g_trl)
    grad_err = max(float((g[n] - g_trl[n]).abs().max()) for n in g_trl)
    assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)
    m_trl = trl_t._metrics["train"]
    m_ours = {k: v for k, v in ours_t._metrics["train"].items() if not k.startswith("fastgrpo/")}
    assert set(m_ours) == set(m_trl)
    for k in m_trl:
        assert m_ours[k] == pytest.approx(m_trl[k], abs=TOL), k
    assert ours_t.entropy_coef == pytest.approx(trl_t.entropy_coef, abs=1e-12)
    assert ours_t._last_world_entropy == pytest.approx(trl_t._last_world_entropy, abs=TOL)
    return loss_err, grad_err


CASES = {  # id: (loss_type, importance level, options)
    "cispo": ("cispo", "token", {}),
    "sapo": ("sapo", "token", {}),
    "sapo-sequence": ("sapo", "sequence", {}),
    "luspo-sequence": ("luspo", "sequence", {"delta": 1.5}),
    "luspo-token": ("luspo", "token", {}),
    "vespo": ("vespo", "token", {"beta": 0.0}),
    "off_policy_mask-dapo": ("dapo", "token", {"off_policy_mask_threshold": 0.05}),
    "entropy_bonus-grpo": ("grpo", "token", {"entropy_coef": 0.03}),
    "entropy_bonus-dr_grpo": ("dr_grpo", "token", {"entropy_coef": 0.03, "delta": 1.5}),
    "adaptive_entropy-bnpo": ("bnpo", "token", {"entropy_coef": 0.02, "use_adaptive_entropy": True,
                                                "last_world_entropy": 0.0, "entropy_target": 10.0}),
    "top_entropy_quantile-dapo": ("dapo", "token", {"top_entropy_quantile": 0.5}),
    "top_entropy_quantile+bonus-grpo": ("grpo", "token", {"top_entropy_quantile": 0.3, "entropy_coef": 0.05}),
    "all-masks-cispo": ("cispo", "token", {"top_entropy_quantile": 0.6, "off_policy_mask_threshold": 0.05,
                                          "entropy_coef": 0.01}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_objective_equals_trl(qwen2, case):
    loss_type, level, opts = CASES[case]
    compare(*qwen2, loss_type, level, **opts)


def test_the_masks_bite(qwen2):
    """Guards the cases above against options that change nothing on this batch."""
    model, inputs = qwen2
    base = _stand_in(model, "dapo")
    ref = float(base._trl_compute_loss(model, inputs).detach())
    for opts in ({"off_policy_mask_threshold": 0.05}, {"top_entropy_quantile": 0.5}, {"entropy_coef": 0.03}):
        t = _stand_in(model, "dapo", **opts)
        assert abs(float(t._trl_compute_loss(model, inputs).detach()) - ref) > 1e-4, opts


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_soft_capped_scaled_logits_equal_trl(capped, loss_type):
    compare(*capped, loss_type, "token")


@pytest.mark.parametrize("loss_type", ["dapo", "sapo"])
def test_moe_aux_loss_equals_trl(moe, loss_type):
    model, inputs = moe
    compare(model, inputs, loss_type, "token", router_aux_loss_coef=0.02)


@pytest.mark.parametrize("softcap,scale,bias", [(None, 1.0, False), (None, 0.6, True), (3.0, 1.0, False),
                                                (1.5, 2.0, True)])
def test_fused_head_equals_autograd(softcap, scale, bias):
    """Chunked head (chunks of 5 over 13 tokens) vs autograd through explicit logits, float64."""
    g = torch.Generator().manual_seed(0)
    n, h_dim, v = 13, 8, 37
    hidden = torch.randn(n, h_dim, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h_dim, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    cg, ch = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    def grads(logp, ent):
        (cg * logp + ch * ent).sum().backward()
        out = [hidden.grad.clone(), weight.grad.clone()] + ([b.grad.clone()] if bias else [])
        for p in (hidden, weight, b):
            if p is not None:
                p.grad = None
        return logp.detach(), ent.detach(), out

    lp, en, gr = grads(*fused_head_logprobs(hidden, weight, y, TAU, bias=b, softcap=softcap, scale=scale,
                                            chunk_size=5))
    z = hidden @ weight.t() + (b if bias else 0)
    z = z * scale if softcap is None else softcap * torch.tanh(z * scale / softcap)
    logq = torch.log_softmax(z / TAU, -1)
    lp_ref, en_ref, gr_ref = grads(logq.gather(1, y[:, None])[:, 0], -(logq.exp() * logq).sum(-1))
    assert float((lp - lp_ref).abs().max()) <= 1e-12 and float((en - en_ref).abs().max()) <= 1e-12
    for a, r in zip(gr, gr_ref):
        assert float((a - r).abs().max()) <= 1e-12


def test_counts_and_metrics_per_path(qwen2):
    """One stats object per run: fused, TRL-objective and fallback micro-batches, by reason, as
    metrics (`fastgrpo/*`) and a summary line; a fallback warns once per option."""
    model, inputs = qwen2
    t = _stand_in(model, "dapo")
    t.fastgrpo_stats = FastGRPOStats()
    with torch.no_grad():
        fastgrpo_compute_loss(t, model, inputs)  # fused
        t.loss_type = "cispo"
        fastgrpo_compute_loss(t, model, inputs)  # TRL's objective on our head
        t.loss_type = "some_future_loss"
        with pytest.warns(UserWarning, match="some_future_loss"):  # named before TRL's own loss raises on it
            with pytest.raises(ValueError, match="Unknown loss type"):
                fastgrpo_compute_loss(t, model, inputs)
    s = t.fastgrpo_stats
    assert (s.fused, sum(s.objective.values()), sum(s.fallback.values())) == (1, 1, 0)
    m = t._metrics["train"]
    assert m["fastgrpo/fallback_frac"] == [0.0, 0.0]  # a fallback that raised ran nothing: not counted
    assert m["fastgrpo/microbatches_fastgrpo"] == [2.0] and m["fastgrpo/microbatches_fallback"] == [0.0]
    assert m["fastgrpo/objective/loss_type_cispo"] == [1.0]
    assert "2 of 2 micro-batches ran fastgrpo's loss (1 fused loss, 1 TRL objective" in s.summary()


def test_vision_inputs_fall_back_counted_and_warned_once(qwen2):
    model, inputs = qwen2
    t = _stand_in(model, "grpo")
    calls = []
    t._trl_compute_loss = lambda m, x: calls.append(1) or torch.zeros(())
    x = dict(inputs, pixel_values=torch.zeros(1))
    with pytest.warns(UserWarning, match="vision inputs") as w:
        for _ in range(3):
            fastgrpo_compute_loss(t, model, x)
    assert len([r for r in w if "fastgrpo" in str(r.message)]) == 1 and len(calls) == 3
    m = t._metrics["train"]
    assert m["fastgrpo/fallback_frac"] == [1.0] * 3 and m["fastgrpo/fallback/vision_inputs"] == [3.0]
    assert t._fastgrpo_fallbacks == 3 and "3 fell back to TRL's _compute_loss: vision inputs" in \
        t.fastgrpo_stats.summary()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_tool_mask_is_honored_as_trl_does(qwen2, loss_type):
    """TRL's multi-turn tool path marks tool-result tokens with `tool_mask` 0 (TRL PR#4975: a fused
    loss path that ignored it trained on tool output): our drop-in equals TRL's `_compute_loss` with
    the mask in, and the mask bites (the loss without it differs)."""
    model, inputs = qwen2
    tool = torch.ones_like(inputs["completion_mask"])
    tool[:, 2:5] = 0  # a tool result in the middle of every completion
    with_tool = dict(inputs, tool_mask=tool)
    trl_t, ours_t = _stand_in(model, loss_type), _stand_in(model, loss_type)
    trl_loss, g_trl = _run(trl_t._trl_compute_loss, model, with_tool)
    loss, g = _run(lambda m, x: fastgrpo_compute_loss(ours_t, m, x), model, with_tool)
    assert ours_t.fastgrpo_stats.computed == 1 and not ours_t.fastgrpo_stats.fallback  # fastgrpo's own loss ran
    assert abs(float(loss) - float(trl_loss)) <= TOL
    assert max(float((g[n] - g_trl[n]).abs().max()) for n in g_trl) <= TOL
    t = _stand_in(model, loss_type)
    assert abs(float(t._trl_compute_loss(model, with_tool).detach())
               - float(t._trl_compute_loss(model, inputs).detach())) > 1e-6
