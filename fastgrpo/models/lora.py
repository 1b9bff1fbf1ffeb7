"""LoRA policies (Hu et al. 2021) through PEFT: the adapter is what trains, syncs and checkpoints.

`attach_lora(model, lcfg)` wraps the decoder's linear layers with PEFT's `lora.Linear` (y = W x +
(α/r)·B A x, B = 0 at the start so the adapted model starts as its base) and freezes every base
weight, so the optimizer (fastgrpo.trainer.build.build_optimizer takes the parameters that require
a gradient) holds AdamW state for the adapter alone. `load_adapter_model` does the same from a PEFT
adapter folder (its base named by its adapter_config.json).

What identifies a base is its weights, not its shapes or its name: a base of the same sizes (another
seed, another fine-tune, a folder whose files were replaced) takes an adapter without complaint and
trains on the wrong model. So an adapter fastgrpo saves carries `fastgrpo_base.json`: the base it
was trained on as named, and a few of that base's weights at fixed positions of every tensor
(`base_sample`, taken once when the adapter is attached or loaded: the base is frozen).
`load_adapter_model` and `load_adapter_state` compare that sample with the base they are given
and refuse another base at load (`check_base`), naming both. Compared as bfloat16 (the coarsest
of the dtypes a base is loaded in), so the same base in float32, bfloat16 or float16 matches; an
adapter from elsewhere (no such file) is checked by its shapes only.

Departure from TRL / PEFT's usual object graph: the trainer keeps the *HF model* (its decoder
layers now holding PEFT's wrappers) as its module, not the `PeftModel` around it, so the packed
forward, the fused CPU layers, the built-in engine and the weight sync see the module they know
(`model.model.layers`, `model.lm_head`); the `PeftModel` hangs off it as a plain attribute
(`peft_of`, not a submodule: no second copy in the state dict) for PEFT's own save / load,
`disable_adapter()` (the reference of β > 0 is the base: the same module with the adapter off, no
copy in memory) and merging.

The fast paths read a LoRA'd linear through `lora_terms` (base layer, A, B, scale, or None where
the adapter is off / merged) and `effective_weight` (W + scale·B A, for paths that read weights:
the built-in engine's lean and native decode steps). What none of them can take (dropout in
training, DoRA and other variants, an adapter bias, several active adapters) `lora_terms` names,
and the caller falls back to PEFT's own layer and says so once (`warn_once`).
"""
from __future__ import annotations

import json
import os
import warnings
from contextlib import nullcontext
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

PEFT_ATTR = "_fastgrpo_peft"  # the PeftModel around a LoRA'd HF model (in __dict__: not a submodule)
SYNC_ATTR = "_fastgrpo_lora_sync"  # model.lora.sync: what an engine with weights of its own is sent
BASE_ATTR = "_fastgrpo_lora_base"  # what adapter_config.json names as the base ("tiny", a folder, a hub id)
SAMPLE_ATTR = "_fastgrpo_lora_base_sample"  # base_sample of the base, taken before PEFT wrapped it
ADAPTER_CONFIG = "adapter_config.json"
BASE_FILE = "fastgrpo_base.json"  # in an adapter folder fastgrpo saved: the base it was trained on (check_base)
SAMPLES_PER_TENSOR = 8
# share of sampled values that may differ (as bfloat16) in the same base loaded in another dtype: a
# float16 load rounds twice; another base differs in nearly all of them
BASE_MISMATCH = 0.05
_WARNED: set = set()


def require_peft() -> None:
    """ValueError naming the setting when PEFT (the `lora` extra) is not installed."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ValueError("model.lora: LoRA policies need the peft package; install it with "
                         "pip install 'fastgrpo[lora]' (or pip install 'peft>=0.13'), or set model.lora.rank=0") from None


def warn_once(key: str, msg: str) -> None:
    """One warning per process and `key` (a fast path that steps aside for an adapter)."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"fastgrpo: {msg}", RuntimeWarning, stacklevel=3)


# ------------------------------------------------------------------ the model's decoder linears
def decoder_layers(model) -> Optional[nn.ModuleList]:
    """The decoder layers of a HF causal LM (`model.model.layers` and kin), None when not found."""
    inner = getattr(model, "model", None)
    for holder in (inner, getattr(inner, "decoder", None), getattr(model, "transformer", None)):
        layers = getattr(holder, "layers", None) if holder is not None else None
        if isinstance(layers, nn.ModuleList):
            return layers
        h = getattr(holder, "h", None) if holder is not None else None
        if isinstance(h, nn.ModuleList):
            return h
    return None


def decoder_linear_names(model) -> List[str]:
    """Sorted leaf names of the nn.Linear modules inside the decoder layers (q_proj, …)."""
    layers = decoder_layers(model)
    if layers is None:
        return []
    return sorted({name.rsplit(".", 1)[-1] for name, m in layers.named_modules() if isinstance(m, nn.Linear)})


def target_names(model, lcfg) -> List[str]:
    """model.lora.target_modules checked against the model (empty: every decoder linear)."""
    have = decoder_linear_names(model)
    if not have:
        raise ValueError(f"model.lora.rank={lcfg.rank}: {type(model).__name__} has no decoder layers of linear "
                         "modules that LoRA could wrap")
    for i, name in enumerate(lcfg.target_modules):
        if name not in have:
            raise ValueError(f"config model.lora.target_modules[{i}]={name!r}: matches no linear layer of the decoder; "
                             f"expected some of {have}")
    return list(lcfg.target_modules) or have


# ------------------------------------------------------------------ building
def attach_lora(model, lcfg, base_ref: str = ""):
    """`model` with a fresh adapter of `lcfg` (PEFT's init: A Kaiming-uniform from the global torch
    RNG, B = 0) on its decoder linears, base weights frozen; returns the same HF model object."""
    require_peft()
    from peft import LoraConfig, get_peft_model

    # a list of leaf names (what vLLM's LoRA loader expects in adapter_config.json); the config
    # check refused names outside the decoder layers (lm_head, embeddings)
    pc = LoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout,
                    target_modules=target_names(model, lcfg), bias="none", task_type="CAUSAL_LM")
    sample = base_sample(model)  # before PEFT renames the base's weights
    return _wrap(get_peft_model(model, pc), model, base_ref, sample)


def _wrap(peft_model, model, base_ref: str, sample: Dict[str, List[float]]):
    model.__dict__[PEFT_ATTR] = peft_model
    model.__dict__[BASE_ATTR] = base_ref
    model.__dict__[SAMPLE_ATTR] = sample
    for cfg in peft_model.peft_config.values():
        cfg.base_model_name_or_path = base_ref or cfg.base_model_name_or_path
    return model


def is_adapter_dir(path: str) -> bool:
    return isinstance(path, str) and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def adapter_config(path: str) -> dict:
    try:
        with open(os.path.join(path, ADAPTER_CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path={path!r}: its {ADAPTER_CONFIG} is unreadable ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"model.path={path!r}: a {cfg.get('peft_type')} adapter; expected a LoRA adapter folder")
    return cfg


def adapter_base(path: str) -> str:
    """The base that adapter folder `path` names (adapter_config.json base_model_name_or_path)."""
    base = adapter_config(path).get("base_model_name_or_path") or ""
    if not base:
        raise ValueError(f"model.path={path!r}: its {ADAPTER_CONFIG} names no base model (base_model_name_or_path); "
                         "expected the base's folder or hub id there")
    return base


def load_adapter_model(model, path: str, lcfg=None, trainable: bool = True):
    """The base `model` with the adapter of folder `path` loaded (trainable: its weights require
    a gradient). `lcfg.rank`, when set, must be the folder's rank."""
    require_peft()
    from peft import PeftModel

    r = adapter_config(path).get("r")
    if lcfg is not None and lcfg.rank and r is not None and int(r) != lcfg.rank:
        raise ValueError(f"config model.lora.rank={lcfg.rank}: the adapter of model.path={path!r} has rank {r}; "
                         "expected the same rank (or 0: the folder's own)")
    sample = base_sample(model)
    check_base(path, sample, f"model.path={path!r}")  # the base it was trained on, not one of the same shapes
    peft_model = PeftModel.from_pretrained(model, path, is_trainable=trainable)
    return _wrap(peft_model, model, adapter_base(path), sample)


# ------------------------------------------------------------------ the base an adapter belongs to
@torch.no_grad()
def base_sample(model) -> Dict[str, List[float]]:
    """SAMPLES_PER_TENSOR values of every floating-point tensor of `model`'s state dict, at evenly
    spread positions of the flattened tensor: what tells one base from another of the same shapes."""
    out: Dict[str, List[float]] = {}
    for name, t in model.state_dict().items():
        if not t.is_floating_point() or t.numel() == 0 or t.device.type == "meta":
            continue
        flat = t.reshape(-1)
        idx = torch.linspace(0, flat.numel() - 1, min(SAMPLES_PER_TENSOR, flat.numel())).round().long()
        out[name] = flat[idx.to(flat.device)].float().cpu().tolist()
    return out


def _recorded_base(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, BASE_FILE)) as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{os.path.join(path, BASE_FILE)}: unreadable ({e}); expected the base record fastgrpo "
                         "wrote with the adapter") from None
    return rec if isinstance(rec, dict) and isinstance(rec.get("sample"), dict) else None


def _differing(recorded: Dict[str, List[float]], sample: Dict[str, List[float]]) -> Tuple[int, int, Optional[str]]:
    """(sampled values that differ as bfloat16, values compared, the first tensor with one)."""
    bad = total = 0
    first = None
    for name in sorted(set(recorded) & set(sample)):
        a, b = recorded[name], sample[name]
        if len(a) != len(b):
            bad, total, first = bad + max(len(a), len(b)), total + max(len(a), len(b)), first or name
            continue
        ta = torch.tensor(a, dtype=torch.float32).to(torch.bfloat16)
        tb = torch.tensor(b, dtype=torch.float32).to(torch.bfloat16)
        n = int((ta != tb).sum())
        bad, total = bad + n, total + len(a)
        if n and first is None:
            first = name
    return bad, total, first


def check_base(path: str, sample: Dict[str, List[float]], who: str) -> None:
    """Refuse a base whose weights are not those adapter folder `path` was trained on (its
    BASE_FILE, when fastgrpo saved it): one ValueError naming the base it was trained on and the
    one given. `sample`: base_sample of the given base; `who`: the setting named first."""
    rec = _recorded_base(path)
    if rec is None or not sample:
        return
    bad, total, first = _differing(rec["sample"], sample)
    if total and bad <= BASE_MISMATCH * total:
        return
    trained = rec.get("base_path") or rec.get("base") or "?"
    try:
        named = adapter_base(path)
    except ValueError:
        named = "?"
    shown = os.path.abspath(named) if os.path.exists(named) else named
    why = (f"{bad} of {total} sampled base weights differ, the first in {first}" if total
           else "no base weight of the same name")
    if shown == trained or named == rec.get("base"):
        raise ValueError(f"{who}: the adapter was trained on the base {trained!r}, whose weights have changed since "
                         f"({why}); expected the base it was trained on, unchanged")
    raise ValueError(f"{who}: the adapter was trained on the base {trained!r} ({BASE_FILE}), but its "
                     f"{ADAPTER_CONFIG} names the base {shown!r}, another model of the same shapes ({why}); "
                     f"expected the base it was trained on: set base_model_name_or_path to it")


def _save_base_record(model, path: str) -> None:
    sample = getattr(model, "__dict__", {}).get(SAMPLE_ATTR)
    if not sample:
        return
    base = model.__dict__.get(BASE_ATTR) or ""
    rec = {"base": base, "base_path": os.path.abspath(base) if base and os.path.exists(base) else None,
           "samples_per_tensor": SAMPLES_PER_TENSOR, "sample": sample}
    with open(os.path.join(path, BASE_FILE), "w") as f:
        json.dump(rec, f)


def sync_mode(model) -> str:
    """model.lora.sync of a LoRA module (set by fastgrpo.trainer.build.build_model): adapter | merged."""
    return getattr(model, "__dict__", {}).get(SYNC_ATTR, "adapter")


def peft_of(model):
    """The PeftModel around a LoRA'd HF model (None for any other model)."""
    return getattr(model, "__dict__", {}).get(PEFT_ATTR)


def is_lora(model) -> bool:
    return peft_of(model) is not None


def adapter_disabled(model):
    """Context in which `model` computes as its base (PEFT's `disable_adapter()`); a no-op
    context for a model without an adapter."""
    peft = peft_of(model)
    return peft.disable_adapter() if peft is not None else nullcontext()


# ------------------------------------------------------------------ the adapter's tensors
def adapter_named_tensors(model) -> Dict[str, torch.Tensor]:
    """The adapter's tensors by PEFT's saved names (`base_model.model.<path>.lora_A.weight`), the
    live parameters (no copy): what a sync sends and a checkpoint holds."""
    from peft import get_peft_model_state_dict

    peft = peft_of(model)
    if peft is None:
        raise ValueError(f"{type(model).__name__}: not a LoRA model (model.lora.rank = 0)")
    # save_embedding_layers=False: the embeddings are never adapted here (and "auto" would look the
    # base up on the hub)
    return get_peft_model_state_dict(peft, save_embedding_layers=False)


def adapter_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in adapter_named_tensors(model).values())


def save_adapter(model, path: str) -> str:
    """PEFT's adapter folder (adapter_config.json + adapter_model.safetensors) of `model`, with the
    base it was trained on (BASE_FILE: checked when the adapter is loaded again)."""
    peft_of(model).save_pretrained(path, safe_serialization=True, save_embedding_layers=False)
    _save_base_record(model, path)
    return path


@torch.no_grad()
def load_adapter_state(model, path: str) -> None:
    """Copy the adapter weights of folder `path` into `model`'s adapter in place (resume: the
    optimizer keeps pointing at the same parameters). Names and shapes must match exactly."""
    from safetensors.torch import load_file
    from peft import set_peft_model_state_dict

    check_base(path, getattr(model, "__dict__", {}).get(SAMPLE_ATTR) or {}, f"adapter {path}")
    file = os.path.join(path, "adapter_model.safetensors")
    try:
        state = load_file(file)
    except Exception as e:  # noqa: BLE001 — missing, torn (checksums verify it first in a checkpoint): name it
        raise ValueError(f"{file} does not load ({type(e).__name__}: {e})") from e
    mine = adapter_named_tensors(model)
    if set(state) != set(mine) or any(state[k].shape != mine[k].shape for k in mine):
        odd = sorted(set(state) ^ set(mine))[:3] or [k for k in mine if state[k].shape != mine[k].shape][:3]
        raise ValueError(f"adapter {path}: does not match the model's adapter (first differences: {odd}); expected a "
                         "checkpoint of the same model.lora settings")
    before = [p.data_ptr() for p in mine.values()]
    set_peft_model_state_dict(peft_of(model), state)
    if [p.data_ptr() for p in adapter_named_tensors(model).values()] != before:
        raise RuntimeError("PEFT replaced the adapter's parameters while loading: the optimizer would hold stale ones")


# ------------------------------------------------------------------ what the fast paths read
def lora_terms(m, inference: bool = False) -> Tuple[Optional[nn.Module], Optional[tuple], Optional[str]]:
    """(base linear, (A [r, in], B [out, r], scale) or None, why-not) of a linear `m`:
    a plain linear → (m, None, None); a PEFT LoRA linear with one vanilla adapter on → its base and
    terms; the adapter off or merged → (base, None, None); anything a fast path cannot compute
    (dropout while training, DoRA or another variant, an adapter bias, several adapters) →
    (None, None, reason)."""
    base = getattr(m, "base_layer", None)
    if base is None or not hasattr(m, "lora_A"):
        return m, None, None
    if getattr(m, "disable_adapters", False) or getattr(m, "merged", False):
        return base, None, None
    active = [a for a in m.active_adapters if a in m.lora_A]
    if not active:
        return base, None, None
    if len(active) > 1:
        return None, None, f"{len(active)} active adapters"
    a = active[0]
    if a in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(a, False):
        return None, None, "a DoRA / variant adapter"
    drop = m.lora_dropout[a]
    if m.training and not inference and isinstance(drop, nn.Dropout) and drop.p > 0:
        return None, None, f"adapter dropout {drop.p} while training"
    A, B = m.lora_A[a], m.lora_B[a]
    if not (isinstance(A, nn.Linear) and isinstance(B, nn.Linear)) or A.bias is not None or B.bias is not None:
        return None, None, "an adapter with a bias"
    return base, (A.weight, B.weight, float(m.scaling[a])), None


def effective_weight(m) -> torch.Tensor:
    """The weight a linear `m` computes with: W, or W + scale·B A for an active unmerged adapter
    (a new tensor; for paths that read weights, not modules: sampling, so no dropout)."""
    base, terms, why = lora_terms(m, inference=True)
    if why is not None:
        raise ValueError(f"effective_weight: {why}")
    if terms is None:
        return base.weight
    A, B, s = terms
    return torch.addmm(base.weight, B.to(base.weight.dtype), A.to(base.weight.dtype), alpha=s)


def has_adapter(model) -> bool:
    """Whether some linear of `model` is a LoRA wrapper (PEFT) whatever its state."""
    return any(hasattr(m, "lora_A") and hasattr(m, "base_layer") for m in model.modules())


# ------------------------------------------------------------------ merged weights (export, merged sync)
@torch.no_grad()
def merged_state_dict(model) -> Dict[str, torch.Tensor]:
    """The base model's state dict names with the adapter merged in (W + scale·B A), the base
    left untouched: what a merged HF folder and `lora.sync: merged` carry."""
    out: Dict[str, torch.Tensor] = {}
    wrappers = {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        owner = name.rsplit(".", 2)[0] if ".base_layer." in name else None
        clean = name.replace(".base_layer.", ".")
        if owner in wrappers and name.endswith("base_layer.weight"):
            t = effective_weight(wrappers[owner])
        out[clean] = t
    return out


def named_merged_parameters(model):
    """(name, tensor) pairs like `named_parameters()` of the base model with the adapter merged:
    the full-weight sync of `lora.sync: merged`."""
    sd = merged_state_dict(model)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        yield clean, sd[clean]
