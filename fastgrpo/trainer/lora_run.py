"""A LoRA run's glue around the trainer: the checks at load, the adapter in checkpoints, the merged
export (`fastgrpo export --merge`).

Checks (`check_lora_run`, called by `fastgrpo.pipeline.load_run` before SFT or any engine starts;
every failure one ValueError naming the field): target modules against the model's decoder
linears (naming those that exist), an adapter folder's base (present, and of the architecture
the adapter was trained on: its A / B shapes against the base's linears), and `model.lora.sync=
adapter` against the engine. The model is built on the meta device for this: no weights read.

Checkpoints: a LoRA run's `model/` is PEFT's adapter folder (adapter_config.json +
adapter_model.safetensors, plus the tokenizer) and `state.pt` holds AdamW's state of the adapter
alone — kilobytes to megabytes where full weights are gigabytes. Both are covered by the same
checksums and the same atomic rename as a full checkpoint; resume copies the adapter into the live
parameters in place (the optimizer keeps pointing at them), so a resumed run continues bit-exactly.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn

from fastgrpo.models import lora


class _AdapterSaver:
    """`save_pretrained` of a LoRA module for the checkpoint writer: PEFT's adapter folder only."""

    def __init__(self, module):
        self.module = module

    def save_pretrained(self, path: str, safe_serialization: bool = True, state_dict=None) -> None:
        if state_dict is not None:
            raise ValueError("a LoRA checkpoint saves the live adapter; a gathered state dict (ZeRO-3) is not "
                             "supported with model.lora.rank > 0")
        lora.save_adapter(self.module, path)


def checkpoint_model(module):
    """What a checkpoint saves as `model/`: a LoRA module's adapter folder (adapter_config.json +
    adapter_model.safetensors), the module itself otherwise."""
    return _AdapterSaver(module) if lora.is_lora(module) else module


def resume_adapter(module, ckpt_path: str) -> bool:
    """Load a LoRA checkpoint's adapter into `module` in place; False for a full-weights module."""
    if not lora.is_lora(module):
        return False
    mdir = os.path.join(ckpt_path, "model")
    if not lora.is_adapter_dir(mdir):
        raise ValueError(f"checkpoint {ckpt_path}: holds full weights, but this run trains a LoRA adapter "
                         "(model.lora.rank > 0); expected a checkpoint of a LoRA run, or model.lora.rank=0")
    lora.load_adapter_state(module, mdir)
    return True


# ------------------------------------------------------------------ checks at load
def _meta_model(mcfg, base: str):
    """The base's module on the meta device (no weights): its layers' names and shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastgrpo.trainer.build import is_tiny_ref, tiny_config_of

    if is_tiny_ref(base):
        from fastgrpo.models.tiny import tiny_config
        from fastgrpo.trainer.build import tiny_tokenizer

        mcfg = tiny_config_of(base, mcfg)

        config = tiny_config(mcfg.arch, vocab_size=len(tiny_tokenizer(mcfg)), hidden_size=mcfg.hidden_size,
                             num_hidden_layers=mcfg.num_hidden_layers, intermediate_size=mcfg.intermediate_size,
                             num_attention_heads=mcfg.num_attention_heads, num_key_value_heads=1,
                             head_dim=mcfg.hidden_size // mcfg.num_attention_heads)
    else:
        try:
            config = AutoConfig.from_pretrained(base)
        except (OSError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"model.path={mcfg.path!r}: its base model {base!r} does not load ({first}); expected the "
                             "base's folder or hub id in adapter_config.json base_model_name_or_path") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _check_adapter_fits(path: str, base: str, meta) -> None:
    """Every A [r, in] / B [out, r] of adapter folder `path` on a linear of the base of that shape."""
    from safetensors import safe_open

    files = [f for f in ("adapter_model.safetensors",) if os.path.isfile(os.path.join(path, f))]
    if not files:
        raise ValueError(f"model.path={path!r}: no adapter_model.safetensors in the adapter folder")
    mods = dict(meta.named_modules())
    with safe_open(os.path.join(path, files[0]), framework="pt") as fh:
        for key in fh.keys():
            if ".lora_A." not in key and ".lora_B." not in key:
                continue
            shape = fh.get_slice(key).get_shape()
            owner = key.split(".lora_")[0].removeprefix("base_model.model.")
            m = mods.get(owner)
            side = "A" if ".lora_A." in key else "B"
            fits = isinstance(m, nn.Linear) and len(shape) == 2 and (
                shape[1] == m.in_features if side == "A" else shape[0] == m.out_features)
            if not fits:
                what = "no such linear layer" if not isinstance(m, nn.Linear) else \
                    f"lora_{side} {list(shape)} against a [{m.out_features}, {m.in_features}] linear"
                raise ValueError(f"model.path={path!r}: the adapter does not fit its base {base!r} ({owner}: {what}); "
                                 f"expected an adapter trained on a {type(meta).__name__} of these sizes")


def _check_engine(cfg, meta) -> None:
    if cfg.model.lora.sync != "adapter" or cfg.rollout.engine != "vllm":
        return
    from fastgrpo.rollout.vllm_support import vllm_lora_unsupported_reason

    why = vllm_lora_unsupported_reason(meta)
    if why is not None:
        raise ValueError(f"config model.lora.sync='adapter': rollout.engine=vllm cannot load adapters here ({why}); "
                         "expected model.lora.sync=merged (the adapter merged into full weights at each sync) or "
                         "rollout.engine=torch")


def _check_rank(lcfg, meta, names) -> None:
    """model.lora.rank against the targeted layers, at load (rank 100000 on the demo ran a whole
    SFT, 92 s and 4.8 GB, before vLLM refused it): above min(in, out) of a layer the adapter is a
    dense update at more cost than the layer itself, so it is refused naming the layer."""
    shapes = [(min(mod.in_features, mod.out_features), name) for name, mod in meta.named_modules()
              if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] in names]
    if shapes:
        full, name = min(shapes)
        if lcfg.rank > full:
            raise ValueError(f"config model.lora.rank={lcfg.rank}: above the full rank of {name} (min(in, out) = "
                             f"{full}), where an adapter is a dense update at more cost; expected 1 … {full} (RL "
                             "learns as well at rank 1)")


def check_lora_run(cfg) -> Optional[str]:
    """The LoRA settings of `cfg` against the model and engine (see the module doc); returns the
    adapter folder model.path names, or None. Raises ValueError naming the field."""
    from fastgrpo.trainer.build import is_tiny_ref, resolve_adapter_base, resolve_model_dir, tiny_ref

    m = cfg.model
    path = None if m.path == "tiny" else resolve_model_dir(m.path)
    adapter = path if path and lora.is_adapter_dir(path) else None
    if not m.lora.rank and adapter is None:
        return None
    lora.require_peft()
    base = tiny_ref(m) if m.path == "tiny" else (lora.adapter_base(adapter) if adapter else path)
    if not is_tiny_ref(base):
        base = resolve_adapter_base(m.path, base) if adapter else base
    meta = _meta_model(m, base)
    if adapter:
        _check_adapter_fits(adapter, base, meta)
    else:
        _check_rank(m.lora, meta, lora.target_names(meta, m.lora))
    _check_engine(cfg, meta)
    d = cfg.distributed
    if d.backend == "deepspeed" and d.zero_stage == 3:
        raise ValueError("config distributed.zero_stage=3: expected 0, 1 or 2 with a LoRA policy (model.lora.rank > 0 "
                         "or an adapter folder as model.path): ZeRO-3 partitions the frozen base, which every rank's "
                         "adapter reads whole; the adapter's own optimizer state is small enough for ZeRO-1 / 2")
    return adapter


# ------------------------------------------------------------------ export
def check_export_target(out: str, overwrite: bool = False) -> None:
    """The folder an export writes must be new or empty; `overwrite` replaces a folder that a
    previous export wrote, and only when every file in it is one that export listed (its marker):
    a user's own file is never deleted (issue 34: a non-empty target was replaced silently, a
    file target moved to a hidden folder). Raises ValueError naming the target and the way out."""
    import json

    from fastgrpo.runs.checkpoint_load import MODEL_MARKER

    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"fastgrpo export: {out} is a file, not a folder; give a new or empty folder to write the "
                         "merged model into")
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if not overwrite:
        raise ValueError(f"fastgrpo export: {out} is not empty ({len(os.listdir(out))} entries); give a new or empty "
                         "folder, or --overwrite to replace an earlier export there")
    try:
        with open(os.path.join(out, MODEL_MARKER)) as f:
            listed = set(json.load(f)["files"]) | {MODEL_MARKER}
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    theirs = sorted(os.path.relpath(os.path.join(d, n), out) for d, _, names in os.walk(out) for n in names
                    if listed is None or os.path.relpath(os.path.join(d, n), out) not in listed)
    if theirs:
        raise ValueError(f"fastgrpo export --overwrite: {out} holds files fastgrpo did not write ({', '.join(theirs[:3])}"
                         f"{', …' if len(theirs) > 3 else ''}); they are never deleted: give a new or empty folder")


def export_merged(run: str, out: str, dtype: Optional[str] = None, overwrite: bool = False) -> str:
    """`fastgrpo export --merge <run> <folder>`: the run's (or checkpoint's, or adapter folder's)
    adapter merged into its base, written as a plain HF folder (config, safetensors, tokenizer)
    that transformers and vLLM load without PEFT, into a new or empty folder (`overwrite`: or
    over an earlier export, `check_export_target`). Returns `out`."""
    from fastgrpo.config import ModelConfig
    from fastgrpo.trainer.build import build_model, resolve_model_dir
    from fastgrpo.runs.checkpoint import save_model_atomic

    check_export_target(out, overwrite)  # before minutes of loading and merging
    path = resolve_model_dir(run)
    if not lora.is_adapter_dir(path):
        raise ValueError(f"fastgrpo export --merge {run}: {path} holds no LoRA adapter (adapter_config.json); "
                         "expected a LoRA run folder, one of its checkpoints, or a PEFT adapter folder")
    model, tok = build_model(ModelConfig(path=run, **({"dtype": dtype} if dtype else {})))
    merged = lora.peft_of(model).merge_and_unload()  # W ← W + (α/r)·B A, the wrappers gone
    from fastgrpo.models.patch import unpatch_model

    unpatch_model(merged)
    return save_model_atomic(merged, tok, out, what="the merged model",
                             advice="free space (or give a folder on another disk) and run the same command; "
                                    "nothing was left in the folder")

