"""TRL drop-in: TRL's `GRPOTrainer` computes its loss with fastgrpo.

    from fastgrpo.integrations.trl import FastGRPOTrainer      # instead of trl.GRPOTrainer
    trainer = FastGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    # or, on a trainer already built:  patch_trl_loss(trainer)

Follows TRL 1.16 `GRPOTrainer._compute_loss` for loss types grpo, bnpo, dr_grpo and dapo (their
mapping to the loss contract is `fastgrpo.loss.trl_loss_config`): same loss value, same
gradients, same logged metrics (`entropy`, `kl`, `clip_ratio/*`). Where TRL runs the backbone,
then its chunked log-prob head over padded rows, then the surrogate as a dozen [B, T] tensor
ops, the drop-in runs the backbone, keeps only the hidden states that predict real completion
tokens (padding dropped: the packed layout), and computes log-probs, entropy, ratio, clipping,
KL and the aggregation in one fused pass (`fused_linear_grpo_loss`: the [N, V] logits are never
materialised; Triton on GPU, vocabulary-chunked torch on CPU).

The forward goes through the (possibly DDP / DeepSpeed-wrapped) model, like TRL's own fused
head, so the wrappers' gradient hooks see it. Departure: configurations outside that contract
— other loss types (cispo, sapo, vespo, luspo), TRL's entropy bonus, top-entropy masking, the
off-policy sequence mask, MoE auxiliary loss, vision inputs, logit soft-capping / scaling — are
passed to TRL's own `_compute_loss` unchanged (counted in `trainer._fastgrpo_fallbacks`).
"""
from __future__ import annotations

import functools
import types
import warnings
from contextlib import nullcontext
from typing import Optional

import torch
from trl import GRPOTrainer

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "spatial_shapes",
                "num_tiles", "image_position_ids", "token_type_ids", "mm_token_type_ids")


def _fallback_reason(trainer, inputs) -> Optional[str]:
    """Why this batch must go through TRL's own loss, or None when fastgrpo reproduces it."""
    if trainer.loss_type not in SUPPORTED_LOSS_TYPES:
        return f"loss_type={trainer.loss_type!r} (fastgrpo reproduces {SUPPORTED_LOSS_TYPES})"
    if getattr(trainer, "_entropy_bonus_enabled", False):
        return "the entropy bonus (entropy_coef / adaptive entropy)"
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        return "top_entropy_quantile < 1"
    if getattr(trainer, "off_policy_mask_threshold", None) is not None:
        return "off_policy_mask_threshold"
    if getattr(trainer, "aux_loss_enabled", False):
        return "the MoE auxiliary loss"
    if any(inputs.get(k) is not None for k in _VISION_KEYS):
        return "vision inputs"
    cfg = trainer.model.config.get_text_config()
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                 "logits_scaling"):
        if getattr(cfg, name, None) not in (None, 1.0):
            return f"config.{name}"
    return None


class _LossRequest:
    """What the patched forward needs besides the model inputs (a plain object: DDP and
    accelerate pass it through untouched)."""

    def __init__(self, on, targets, fields, cu_seqlens, spec, fp32_head):
        self.on, self.targets, self.fields, self.cu_seqlens = on, targets, fields, cu_seqlens
        self.spec, self.fp32_head = spec, fp32_head


def _zero3() -> bool:
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover - transformers without the deepspeed integration
        return False
    return is_deepspeed_zero3_enabled()


def _packed_loss(model, request: _LossRequest, backbone_out):
    from fastgrpo.loss import fused_linear_grpo_loss, grpo_loss

    hidden = backbone_out.last_hidden_state
    c = request.on.shape[1]
    # position t predicts token t+1: completion token j of a row is predicted at P-1+j
    h = hidden[:, -(c + 1):-1][request.on]
    head = model.get_output_embeddings()
    f = request.fields
    kw = dict(mask=f["mask"], old_logp=f["old_logp"], ref_logp=f["ref_logp"], weights=f["weights"],
              cu_seqlens=request.cu_seqlens, config=request.spec.config, num_items=request.spec.num_items,
              return_entropy=True)
    if _zero3():
        # ZeRO-3 shards the head weight and gathers it only inside the head's own forward (and
        # the fused path re-reads the weight in its backward): call the module, loss on logits
        logits = head(h.float() if request.fp32_head else h)
        return grpo_loss(logits.float() if request.fp32_head else logits, request.targets, f["advantages"], **kw)
    weight, bias = head.weight, head.bias
    if request.fp32_head:
        h, weight = h.float(), weight.float()
        bias = None if bias is None else bias.float()
    return fused_linear_grpo_loss(h.to(weight.dtype), weight, request.targets, f["advantages"], bias=bias, **kw)


def _install_forward(model) -> None:
    """Wrap `model.forward` (TRL's fused-head forward) so that `model(..., fastgrpo_loss=req)`
    returns fastgrpo's LossOutput; any other call is the previous forward, unchanged."""
    if getattr(model, "_fastgrpo_forward", False):
        return
    previous = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fastgrpo_loss: Optional[_LossRequest] = None, **kwargs):
        if fastgrpo_loss is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        out = self.base_model(*args, **kwargs)  # the backbone, without the lm_head
        return _packed_loss(self, fastgrpo_loss, out)

    model.forward = types.MethodType(forward, model)
    model._fastgrpo_forward = True


def _to_padded(values: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """Packed [N] → TRL's padded [B, T] layout (zeros off the completion), for its metrics."""
    return torch.zeros(on.shape, dtype=values.dtype, device=values.device).masked_scatter(on, values)


def _log_metrics(trainer, inputs, out, on, mask, old_logp):
    """TRL's `_compute_loss` metrics, from the loss's detached per-token outputs."""
    from trl.trainer.utils import nanmax, nanmin

    mode = "train" if trainer.model.training else "eval"
    acc = trainer.accelerator
    m = mask.to(torch.float32)
    logp = _to_padded(out.logp.float(), on)
    adv = inputs["advantages"]
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv

    def global_masked_mean(x):
        if x.shape[1] == 1:  # sequence-level quantities: one value per sequence
            totals = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
        else:
            totals = torch.stack([(x * m).sum(), m.sum()])
        totals = acc.reduce(totals, reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def masked_seq_mean(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * m).sum(-1) / m.sum(-1)

    log_ratio = logp - old_logp.float()
    if trainer.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    if trainer.beta != 0.0:
        ref = inputs["ref_per_token_logps"].float()
        d = ref - logp
        kl = torch.exp(d) - d - 1
        if trainer.args.use_bias_correction_kl:
            kl = kl * ratio
        trainer._metrics[mode]["kl"].append(global_masked_mean(kl))
    trainer._metrics[mode]["entropy"].append(global_masked_mean(_to_padded(out.entropy.float(), on)))
    low = ((ratio < 1 - trainer.epsilon_low) & (adv < 0)).float()
    high = ((ratio > 1 + trainer.epsilon_high) & (adv > 0)).float()
    trainer._metrics[mode]["clip_ratio/low_mean"].append(global_masked_mean(low))
    trainer._metrics[mode]["clip_ratio/high_mean"].append(global_masked_mean(high))
    trainer._metrics[mode]["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
    trainer._metrics[mode]["clip_ratio/low_min"].append(nanmin(acc.gather(masked_seq_mean(low))).item())
    trainer._metrics[mode]["clip_ratio/high_max"].append(nanmax(acc.gather(masked_seq_mean(high))).item())


def _accumulation_steps(trainer, training: bool) -> int:
    """The accumulation steps TRL's `_compute_loss` divides by: transformers sets
    `current_gradient_accumulation_steps` only inside its training loop, so `evaluate()` before
    training (or `eval_on_start=True`) has none; TRL uses 1 in eval, and so do we."""
    if not training:
        return 1
    steps = getattr(trainer, "current_gradient_accumulation_steps", None)
    return int(steps if steps is not None else trainer.args.gradient_accumulation_steps)


def fastgrpo_compute_loss(trainer, model, inputs):
    """Drop-in for `GRPOTrainer._compute_loss(model, inputs)` (see the module docstring)."""
    from fastgrpo.advantages import broadcast_to_tokens
    from fastgrpo.integrations.trl_config import trl_loss_config

    reason = _fallback_reason(trainer, inputs)
    if reason is not None:
        if not getattr(trainer, "_fastgrpo_warned", False):
            warnings.warn(f"fastgrpo: {reason} is outside the fused loss; using TRL's own _compute_loss", stacklevel=2)
            trainer._fastgrpo_warned = True
        trainer._fastgrpo_fallbacks = getattr(trainer, "_fastgrpo_fallbacks", 0) + 1
        return trainer._trl_compute_loss(model, inputs)

    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    on = completion_mask.bool()  # the tokens TRL scores; tool tokens stay in with loss mask 0
    lengths = on.sum(1)
    cu = torch.zeros(on.shape[0] + 1, dtype=torch.int64)
    cu[1:] = lengths.cpu().cumsum(0)
    training = trainer.model.training
    num_items = inputs.get("num_items_in_batch")
    spec = trl_loss_config(
        trainer.loss_type, epsilon=trainer.epsilon_low, epsilon_high=trainer.epsilon_high, delta=trainer.args.delta,
        beta=trainer.beta, use_bias_correction_kl=trainer.args.use_bias_correction_kl,
        importance_sampling_level=trainer.importance_sampling_level, temperature=trainer.temperature,
        max_completion_length=trainer.max_completion_length,
        num_items_in_batch=None if num_items is None else float(num_items),
        num_processes=trainer.accelerator.num_processes,
        gradient_accumulation_steps=_accumulation_steps(trainer, training),
        steps_per_generation=trainer.args.steps_per_generation, training=training)
    adv = inputs["advantages"]
    adv_tok = broadcast_to_tokens(adv, cu.to(adv.device)) if adv.dim() == 1 else adv[on]
    old = inputs.get("old_per_token_logps")
    ref = inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None
    isr = None
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        isr = inputs["importance_sampling_ratio"]
        isr = isr.expand(on.shape)[on]  # token-level [B, T] or sequence-level [B, 1] ratios
    # float64 models (parity tests) keep float64 side inputs; everything else runs in float32
    head_dtype = trainer.model.get_output_embeddings().weight.dtype
    dtype = torch.float64 if head_dtype == torch.float64 else torch.float32
    fields = {"advantages": adv_tok.to(dtype), "mask": mask[on].to(dtype),
              "old_logp": None if old is None else old[on].to(dtype),
              "ref_logp": None if ref is None else ref[on].to(dtype),
              "weights": None if isr is None else isr.to(dtype)}
    request = _LossRequest(on, completion_ids[on], fields, cu, spec,
                           bool(getattr(trainer.args, "cast_lm_head_to_fp32", False)))
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    ctx = trainer.accelerator.autocast() if hasattr(trainer.accelerator, "autocast") else nullcontext()
    with ctx:
        out = model(input_ids=input_ids, attention_mask=attention_mask, fastgrpo_loss=request)
    trainer._fastgrpo_calls = getattr(trainer, "_fastgrpo_calls", 0) + 1
    old_padded = old if old is not None else _to_padded(out.logp.float(), on)
    _log_metrics(trainer, inputs, out, on, mask, old_padded)
    return out.loss * spec.loss_scale


def patch_trl_loss(trainer: GRPOTrainer) -> GRPOTrainer:
    """Make an existing `trl.GRPOTrainer` compute its loss with fastgrpo (one call, before
    `train()`); returns the trainer. TRL's own loss stays reachable as `trainer._trl_compute_loss`."""
    if not isinstance(trainer, GRPOTrainer):
        raise ValueError(f"trainer: expected a trl.GRPOTrainer, got {type(trainer).__name__}")
    if getattr(trainer, "_fastgrpo_patched", False):
        return trainer
    from accelerate.utils import is_peft_model

    model = trainer.model.get_base_model() if is_peft_model(trainer.model) else trainer.model
    _install_forward(model)
    trainer._trl_compute_loss = types.MethodType(GRPOTrainer._compute_loss, trainer)
    if not isinstance(trainer, FastGRPOTrainer):
        trainer._compute_loss = types.MethodType(fastgrpo_compute_loss, trainer)
    trainer._fastgrpo_calls, trainer._fastgrpo_fallbacks, trainer._fastgrpo_patched = 0, 0, True
    return trainer


class FastGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose loss is fastgrpo's fused GRPO loss (see the module docstring);
    same constructor. `self._fastgrpo_calls` counts the micro-batches it computed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        patch_trl_loss(self)

    def _compute_loss(self, model, inputs):
        return fastgrpo_compute_loss(self, model, inputs)
