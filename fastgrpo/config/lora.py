"""`model.lora`: the adapter's settings and their checks at load (no model needed; the checks that
need the model's layers or an adapter folder run in `fastgrpo.models.lora.check_lora_model`).

Defaults follow "LoRA Without Regret" (Schulman et al., Thinking Machines 2025): every linear layer
of the decoder (MLPs included: attention-only LoRA underperforms), α = 32 with the 1/r scaling (the
best learning rate is then nearly independent of the rank), no dropout. Rank 0 is full fine-tuning.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

SYNC_MODES = ("adapter", "merged")
# outside the decoder layers: the fused lm_head + loss reads the head's weight itself, and the
# engines share or copy the embeddings as they are (an adapter there would be skipped)
NOT_TARGETS = ("lm_head", "embed_tokens", "wte", "embed_out", "output")


@dataclass
class LoRAConfig:
    rank: int = 0  # r of every adapter; 0 = off (full weights train). RL learns as well as full fine-tuning even at r = 1 (LoRA Without Regret)
    alpha: float = 32.0  # the adapter's product is scaled by alpha / rank (32 with 1/r: the best lr then barely moves with r)
    dropout: float = 0.0  # dropout on the adapter's input (0 keeps the fused CPU decoder layers; > 0 falls back to PEFT's layers)
    target_modules: List[str] = field(default_factory=list)  # leaf names of decoder linears (q_proj, down_proj, …); empty = every linear of the decoder layers
    sync: str = "adapter"  # adapter: engines get the base once, then the adapter alone | merged: base + adapter merged, every weight sent (engines without LoRA)


def _defaults_changed(lc: LoRAConfig) -> List[str]:
    d = LoRAConfig()
    return [n for n in ("alpha", "dropout", "target_modules", "sync") if getattr(lc, n) != getattr(d, n)]


def check_lora_config(lc: LoRAConfig, bad) -> None:
    """Range checks of model.lora; `bad(path, value, want)` raises (fastgrpo.config.load._bad)."""
    if lc.rank < 0 or (lc.rank == 0 and _defaults_changed(lc)):
        set_ = _defaults_changed(lc)
        bad("model.lora.rank", lc.rank, "an integer >= 1 (the adapter's rank)"
            + (f" when model.lora.{set_[0]} is set (rank 0 turns LoRA off: remove the model.lora fields "
               "for full fine-tuning)" if set_ else "; 0 turns LoRA off"))
    if not lc.alpha > 0:
        bad("model.lora.alpha", lc.alpha, "a number > 0 (the adapter's product is scaled by alpha / rank)")
    if not 0 <= lc.dropout < 1:
        bad("model.lora.dropout", lc.dropout, "a number in [0, 1)")
    if lc.sync not in SYNC_MODES:
        bad("model.lora.sync", lc.sync, f"one of {list(SYNC_MODES)}")
    for i, name in enumerate(lc.target_modules):
        if not isinstance(name, str) or not name.strip() or not name.replace("_", "").replace(".", "").isalnum():
            bad(f"model.lora.target_modules[{i}]", name, "the leaf name of a linear layer of the decoder, e.g. q_proj")
        if name in NOT_TARGETS:
            bad(f"model.lora.target_modules[{i}]", name, "a linear layer inside the decoder layers (the lm_head and "
                "the embeddings stay frozen: the fused lm_head + loss reads the head's weight directly)")
    if len(set(lc.target_modules)) != len(lc.target_modules):
        bad("model.lora.target_modules", lc.target_modules, "each name once")
