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
head, so the wrappers' gradient hooks see it. Three paths per micro-batch (`_route`):
- fused: loss types grpo, bnpo, dr_grpo, dapo with ε_low/ε_high, δ, β·k3, GSPO ratios and vLLM
  importance weights: `fused_linear_grpo_loss`, gradient made in the forward (3 matmuls);
- objective: loss types cispo, sapo, luspo, vespo, the entropy bonus (static or adaptive),
  `top_entropy_quantile`, `off_policy_mask_threshold`, the MoE auxiliary loss, soft-capped or
  scaled logits: TRL's own `_compute_loss`, with its `_get_per_token_logps_and_entropies`
  answered by fastgrpo's fused head (`trl_head.py`: packed, chunked, no [N, V] logits, TRL's
  logit transform, the load-balancing loss from the router logits). The O(B·T) objective is then
  TRL's by construction (its definitions, masks, adaptive-entropy state and metrics); the
  O(N·V) work is ours (4 matmuls: the objective is known only after the log-probs);
- fallback: vision inputs and loss types TRL 1.16 does not define go to TRL's `_compute_loss`
  unchanged, warned once per option.
`trainer.fastgrpo_stats` counts micro-batches per path and reason; the counts are logged as
`fastgrpo/microbatches_fastgrpo`, `fastgrpo/microbatches_fallback` (run totals),
`fastgrpo/fallback_frac` (per logging window), `fastgrpo/{objective,fallback}/<option>`, and
as one line when `train()` returns.
"""
from __future__ import annotations

import functools
import logging
import types
import warnings
from collections import Counter
from contextlib import nullcontext
from typing import Optional

import torch

from fastgrpo.integrations.trl_console import quiet_vllm_notice, report_loss_paths

quiet_vllm_notice()  # before TRL's trainer modules load: they bind `is_vllm_available` at import

from trl import GRPOTrainer  # noqa: E402  (after quiet_vllm_notice)

from fastgrpo.integrations.trl_head import fused_head_logprobs, head_logit_transform

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # the fused loss contract
OBJECTIVE_LOSS_TYPES = ("cispo", "sapo", "luspo", "vespo")  # TRL's objective on fastgrpo's log-probs
_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "spatial_shapes",
                "num_tiles", "image_position_ids", "token_type_ids", "mm_token_type_ids")
_log = logging.getLogger(__name__)


def _route(trainer, inputs):
    """(path, key, reason) of one micro-batch. path "fused": `fused_linear_grpo_loss`; "objective":
    fastgrpo's fused head (log-probs, entropy, MoE auxiliary loss) under TRL's own O(B·T)
    objective; "fallback": TRL's `_compute_loss` unchanged. key / reason name the option that
    moved it off the fused path (None on it)."""
    if any(inputs.get(k) is not None for k in _VISION_KEYS):
        return "fallback", "vision_inputs", "vision inputs (the backbone's image path is TRL's)"
    if trainer.loss_type not in SUPPORTED_LOSS_TYPES + OBJECTIVE_LOSS_TYPES:
        return "fallback", "loss_type", (f"loss_type={trainer.loss_type!r} (fastgrpo knows "
                                         f"{SUPPORTED_LOSS_TYPES + OBJECTIVE_LOSS_TYPES})")
    if trainer.loss_type in OBJECTIVE_LOSS_TYPES:
        return "objective", f"loss_type_{trainer.loss_type}", f"loss_type={trainer.loss_type!r}"
    if getattr(trainer, "_entropy_bonus_enabled", False):
        return "objective", "entropy_bonus", "the entropy bonus (entropy_coef / use_adaptive_entropy)"
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        return "objective", "top_entropy_quantile", "top_entropy_quantile < 1"
    if getattr(trainer, "off_policy_mask_threshold", None) is not None:
        return "objective", "off_policy_mask_threshold", "off_policy_mask_threshold"
    if getattr(trainer, "aux_loss_enabled", False):
        return "objective", "moe_aux_loss", "the MoE auxiliary loss"
    softcap, scale = head_logit_transform(trainer.model.config.get_text_config())
    if softcap is not None or scale != 1.0:
        return "objective", "logit_transform", "final_logit_softcapping / logit scaling"
    return "fused", None, None


class FastGRPOStats:
    """Per-run count of micro-batches by path (see `_route`), with the reason for each one off
    the fused path. Logged as `fastgrpo/*` metrics at every logging step and as one line when
    `train()` returns."""

    def __init__(self):
        self.fused = 0
        self.objective: Counter = Counter()  # reason → micro-batches on TRL's objective over our head
        self.fallback: Counter = Counter()  # reason → micro-batches on TRL's own loss
        self.warned: set = set()

    @property
    def computed(self) -> int:
        return self.fused + sum(self.objective.values())

    def summary(self) -> str:
        total = self.computed + sum(self.fallback.values())
        line = (f"fastgrpo: {self.computed} of {total} micro-batches ran fastgrpo's loss ({self.fused} fused loss, "
                f"{sum(self.objective.values())} TRL objective on fastgrpo's fused head")
        if self.objective:
            line += ": " + ", ".join(f"{r} x{n}" for r, n in self.objective.items())
        line += f"); {sum(self.fallback.values())} fell back to TRL's _compute_loss"
        if self.fallback:
            line += ": " + ", ".join(f"{r} x{n}" for r, n in self.fallback.items())
        return line


def _announce(trainer, path, key, reason):
    """Once per option and run: a warning for a fallback (fastgrpo cannot honour the option),
    an info line for TRL's objective on fastgrpo's head. Before the loss, so that a fallback
    that raises is still named."""
    stats = trainer.fastgrpo_stats
    if path == "fused" or key in stats.warned:
        return
    stats.warned.add(key)
    if path == "objective":
        _log.info("fastgrpo: %s: TRL's objective on fastgrpo's fused lm head (log-probs, entropy)", reason)
    else:
        warnings.warn(f"fastgrpo: {reason} is outside fastgrpo's loss; such micro-batches use TRL's own "
                      "_compute_loss (counted in trainer.fastgrpo_stats and the fastgrpo/* metrics)", stacklevel=4)


def _record(trainer, path, key, reason):
    """Count a micro-batch that ran (see FastGRPOStats) and log the counts as metrics."""
    stats = trainer.fastgrpo_stats
    if path == "fused":
        stats.fused += 1
    elif path == "objective":
        stats.objective[reason] += 1
    else:
        stats.fallback[reason] += 1
    trainer._fastgrpo_calls, trainer._fastgrpo_fallbacks = stats.computed, sum(stats.fallback.values())
    metrics = trainer._metrics["train" if trainer.model.training else "eval"]
    metrics["fastgrpo/fallback_frac"].append(1.0 if path == "fallback" else 0.0)  # averaged per logging window
    # run totals: one value, so the window average TRL logs is the total itself
    metrics["fastgrpo/microbatches_fastgrpo"] = [float(stats.computed)]
    metrics["fastgrpo/microbatches_fallback"] = [float(trainer._fastgrpo_fallbacks)]
    if path != "fused":
        counter = stats.objective if path == "objective" else stats.fallback
        metrics[f"fastgrpo/{path}/{key}"] = [float(counter[reason])]


class _LossRequest:
    """What the patched forward needs besides the model inputs (a plain object: DDP and
    accelerate pass it through untouched). kind "loss": fastgrpo's fused loss (a LossOutput);
    kind "logprobs": (logp [N], entropy [N], aux_loss | None) from the fused head."""

    def __init__(self, on, targets, fields, cu_seqlens, spec, fp32_head, kind="loss", head=None, aux=False):
        self.on, self.targets, self.fields, self.cu_seqlens = on, targets, fields, cu_seqlens
        self.spec, self.fp32_head, self.kind, self.head, self.aux = spec, fp32_head, kind, head, aux


def _zero3() -> bool:
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover - transformers without the deepspeed integration
        return False
    return is_deepspeed_zero3_enabled()


def _packed_loss(model, request: _LossRequest, backbone_out):
    from fastgrpo.loss import fused_linear_grpo_loss, grpo_loss

    h, head, weight, bias = _head_inputs(model, request, backbone_out)
    f = request.fields
    kw = dict(mask=f["mask"], old_logp=f["old_logp"], ref_logp=f["ref_logp"], weights=f["weights"],
              cu_seqlens=request.cu_seqlens, config=request.spec.config, num_items=request.spec.num_items,
              return_entropy=True)
    if _zero3():
        # ZeRO-3 shards the head weight and gathers it only inside the head's own forward (and
        # the fused path re-reads the weight in its backward): call the module, loss on logits
        logits = head(h)
        return grpo_loss(logits.float() if request.fp32_head else logits, request.targets, f["advantages"], **kw)
    # Under autocast (TRL's bf16=True / fp16=True; on CPU too) the head's matmuls run in the autocast
    # dtype, as TRL's lm_head does, but the fused kernel writes its gradients into buffers of the
    # inputs' dtype: cast explicitly and run the kernel with autocast off (cast_lm_head_to_fp32: fp32).
    amp = _autocast_dtype(h.device)
    if amp is not None and not request.fp32_head and h.dtype != torch.float64:
        h, weight = h.to(amp), weight.to(amp)
        bias = None if bias is None else bias.to(amp)
    with torch.autocast(h.device.type, enabled=False):
        return fused_linear_grpo_loss(h, weight, request.targets, f["advantages"], bias=bias, **kw)


def _autocast_dtype(device: torch.device):
    """The autocast dtype in force on `device`'s type, or None."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def _head_inputs(model, request: _LossRequest, backbone_out):
    """Hidden states that predict the completion tokens [N, H] and the head's weight and bias."""
    c = request.on.shape[1]
    # position t predicts token t+1: completion token j of a row is predicted at P-1+j
    h = backbone_out.last_hidden_state[:, -(c + 1):-1][request.on]
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if request.fp32_head:
        h, weight = h.float(), weight.float()
        bias = None if bias is None else bias.float()
    return h.to(weight.dtype), head, weight, bias


def _packed_logprobs(model, request: _LossRequest, backbone_out, attention_mask):
    """(logp [N], entropy [N], MoE aux loss | None) on the fused head, TRL's logit transform included."""
    from fastgrpo.loss import token_logprobs

    tau, softcap, scale = request.head
    h, head, weight, bias = _head_inputs(model, request, backbone_out)
    if _zero3():  # the sharded head weight exists only inside the head's forward: logits [N, V] then
        z = head(h).float() if request.fp32_head else head(h)
        if softcap is not None:
            z = softcap * torch.tanh(z * (scale / softcap))
        elif scale != 1.0:
            z = z * scale
        logp, ent = token_logprobs(z, request.targets, tau, return_entropy=True, impl="torch")
    else:
        logp, ent = fused_head_logprobs(h, weight, request.targets, tau, bias=bias, softcap=softcap, scale=scale)
    aux = None
    if request.aux:
        # the load-balancing loss every transformers MoE family uses (as TRL's fused head computes it)
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        cfg = model.config.get_text_config()
        num_experts = getattr(cfg, "num_experts", None) or getattr(model, "num_experts")
        aux = load_balancing_loss_func(backbone_out.router_logits, num_experts, cfg.num_experts_per_tok,
                                       attention_mask)
    return logp, ent, aux


def _install_forward(model) -> None:
    """Wrap `model.forward` (TRL's fused-head forward) so that `model(..., fastgrpo_loss=req)`
    returns fastgrpo's LossOutput (or the fused head's log-probs); any other call is the previous
    forward, unchanged."""
    if getattr(model, "_fastgrpo_forward", False):
        return
    previous = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fastgrpo_loss: Optional[_LossRequest] = None, **kwargs):
        if fastgrpo_loss is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        if fastgrpo_loss.kind == "logprobs":
            if fastgrpo_loss.aux:
                kwargs["output_router_logits"] = True
            out = self.base_model(*args, **kwargs)  # the backbone, without the lm_head
            return _packed_logprobs(self, fastgrpo_loss, out, kwargs.get("attention_mask"))
        out = self.base_model(*args, **kwargs)
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


def _trl_objective_on_fused_head(trainer, model, inputs):
    """TRL's own `_compute_loss` with its `_get_per_token_logps_and_entropies` answered by
    fastgrpo's fused head: the O(B·T) objective (loss types, masks, entropy bonus and its adaptive
    controller, aux-loss scaling, metrics) is TRL's by construction, the backbone, lm_head,
    log-softmax, entropy and MoE aux loss are fastgrpo's (packed: padding never reaches the head)."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    on = completion_mask.bool()
    softcap, scale = head_logit_transform(trainer.model.config.get_text_config())
    request = _LossRequest(on, completion_ids[on], None, None, None,
                           bool(getattr(trainer.args, "cast_lm_head_to_fp32", False)), kind="logprobs",
                           head=(float(trainer.temperature), softcap, scale))

    def per_token_logps_and_entropies(model_, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                      compute_entropy=False, compute_aux_loss=False, **vision):
        if logits_to_keep != on.shape[1] or input_ids.shape[0] != on.shape[0]:
            raise RuntimeError(f"fastgrpo: TRL asked for log-probs of a [{input_ids.shape[0]}, {logits_to_keep}] "
                               f"completion block, the micro-batch has {tuple(on.shape)}")
        request.aux = bool(compute_aux_loss)
        ctx = trainer.accelerator.autocast() if hasattr(trainer.accelerator, "autocast") else nullcontext()
        with ctx:
            logp, ent, aux = model_(input_ids=input_ids, attention_mask=attention_mask, fastgrpo_loss=request)
        if ent is not None and ent.dtype == torch.float64 and trainer.top_entropy_quantile < 1.0:
            # TRL takes the entropy quantile in float32 (`.float()`) and keeps tokens at or above it, the
            # quantile token included; float64 entropies would drop that token whenever rounding lifts
            # the float32 threshold above it. Their float32 values (gradient unchanged) keep it, as TRL does.
            ent = ent + (ent.float().to(ent.dtype) - ent).detach()
        return _to_padded(logp, on), (_to_padded(ent, on) if compute_entropy else None), aux

    name = "_get_per_token_logps_and_entropies"
    own = trainer.__dict__.get(name)  # an instance attribute (a stand-in's) is put back afterwards
    setattr(trainer, name, per_token_logps_and_entropies)
    try:
        return trainer._trl_compute_loss(model, inputs)
    finally:
        if own is None:
            delattr(trainer, name)
        else:
            setattr(trainer, name, own)


def fastgrpo_compute_loss(trainer, model, inputs):
    """Drop-in for `GRPOTrainer._compute_loss(model, inputs)` (see the module docstring)."""
    from fastgrpo.advantages import broadcast_to_tokens
    from fastgrpo.integrations.trl_config import trl_loss_config

    if not isinstance(getattr(trainer, "fastgrpo_stats", None), FastGRPOStats):
        trainer.fastgrpo_stats = FastGRPOStats()
    path, key, reason = _route(trainer, inputs)
    _announce(trainer, path, key, reason)
    if path == "fallback":
        loss = trainer._trl_compute_loss(model, inputs)
        _record(trainer, path, key, reason)
        return loss
    if path == "objective":
        loss = _trl_objective_on_fused_head(trainer, model, inputs)
        _record(trainer, path, key, reason)
        return loss

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
    _record(trainer, "fused", None, None)
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
        trainer._compute_loss = types.MethodType(_compute_loss_entry, trainer)
    trainer._fastgrpo_calls, trainer._fastgrpo_fallbacks, trainer._fastgrpo_patched = 0, 0, True
    trainer.fastgrpo_stats = FastGRPOStats()
    if getattr(trainer, "use_liger_kernel", False) and hasattr(GRPOTrainer, "compute_liger_loss"):
        # a TRL with `compute_liger_loss` (1.0-1.9 among them) sends every micro-batch to Liger's
        # fused GRPO loss and never calls `_compute_loss`: say so rather than count nothing
        warnings.warn("fastgrpo: use_liger_kernel=True: this TRL computes the loss with Liger's "
                      "compute_liger_loss, not with `_compute_loss`; fastgrpo's loss is not used (set "
                      "use_liger_kernel=False for it)", stacklevel=3)
    train = trainer.train

    @functools.wraps(train)
    def train_and_report(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        finally:
            report_loss_paths(trainer, _log)

    trainer.train = train_and_report
    return trainer


class FastGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose loss is fastgrpo's fused GRPO loss (see the module docstring);
    same constructor. `self.fastgrpo_stats` counts the micro-batches by path, with reasons."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        patch_trl_loss(self)

    def _compute_loss(self, model, inputs, *args, **kwargs):
        return _compute_loss_entry(self, model, inputs, *args, **kwargs)


def _compute_loss_entry(trainer, model, inputs, *args, **kwargs):
    """`_compute_loss` of a patched trainer. A TRL whose `_compute_loss` takes more than
    (model, inputs): what those arguments mean is unknown here, so TRL computes such micro-batches
    (warned once naming them, counted as fallbacks)."""
    if args or kwargs:
        return _trl_loss_for_unknown_arguments(trainer, model, inputs, args, kwargs)
    return fastgrpo_compute_loss(trainer, model, inputs)


def _trl_loss_for_unknown_arguments(trainer, model, inputs, args, kwargs):
    if not isinstance(getattr(trainer, "fastgrpo_stats", None), FastGRPOStats):
        trainer.fastgrpo_stats = FastGRPOStats()
    names = ", ".join([f"arg{i + 3}" for i in range(len(args))] + sorted(kwargs))
    key, reason = "compute_loss_arguments", f"_compute_loss({names}) (arguments this TRL passes that fastgrpo does not know)"
    _announce(trainer, "fallback", key, reason)
    loss = trainer._trl_compute_loss(model, inputs, *args, **kwargs)
    _record(trainer, "fallback", key, reason)
    return loss
