"""What vLLM can serve here and how an engine is configured, apart from the engine itself
(fastgrpo.rollout.vllm_engine): whether vLLM is importable and can serve a model or LoRA
adapters, the device-dependent `vllm.LLM` options, the KV bytes of a sequence, a checkpoint's
parameter names, and the progress sink for `LLM.generate`. Importing it does not import vLLM."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Dict, List, Optional

import torch

from fastgrpo import env


# vLLM's CPU attention backend (vllm/v1/attention/backends/cpu_attn.py) serves only these head sizes.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_unsupported_reason(model) -> Optional[str]:
    """None when vLLM can serve `model` (an HF module) on this machine, else why not."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if not torch.cuda.is_available() and head_dim not in VLLM_CPU_HEAD_DIMS:
        return f"head_dim={head_dim}, and vLLM's CPU attention needs one of {VLLM_CPU_HEAD_DIMS}"
    return None


def engine_options(device_type: str, *, gpu_memory_utilization: float = 0.5,
                   sleep_mode: bool = False) -> Dict[str, Any]:
    """The `vllm.LLM` kwargs that depend on the device: on CUDA the memory fraction and sleep
    mode (only when asked: it installs the one-per-process CuMem allocator); on CPU none
    (vLLM's CPU worker has neither)."""
    if device_type == "cuda":
        return dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=bool(sleep_mode))
    if device_type == "cpu":
        return {}
    raise ValueError(f"device_type={device_type!r}: expected 'cuda' or 'cpu'")


def vllm_lora_unsupported_reason(model=None) -> Optional[str]:
    """None when this vLLM can serve LoRA adapters (`enable_lora` + a `LoRARequest` per sync,
    fastgrpo.sync.adapter), else why not."""
    if not vllm_available():
        return "the vllm package is not importable"
    try:
        from vllm.lora.request import LoRARequest  # noqa: F401
    except ImportError as e:
        return f"this vLLM has no LoRA support ({e})"
    return None


def vllm_available() -> bool:
    env.apply_vllm_defaults()
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def counting_bar(progress):
    """A tqdm class for `LLM.generate(use_tqdm=…)` that draws nothing and hands each finished
    request's count to `progress`: vLLM's own "Processed prompts" bar would be a second bar beside
    the evaluation's (vLLM reads its `n`, `format_dict` and `postfix`, so it is a real tqdm)."""
    from tqdm import tqdm

    class _Sink:
        def write(self, _s):
            pass

        def flush(self):
            pass

    class CountingBar(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "file": _Sink()})

        def update(self, n=1):
            progress(n)
            return super().update(n)

    return CountingBar


def kv_bytes_per_sequence(path: str, max_model_len: int, dtype: torch.dtype) -> int:
    """K and V of every layer for max_model_len tokens: 2 · layers · kv_heads · head_dim · bytes · len."""
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    heads = cfg.get("num_attention_heads", 1)
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return 2 * cfg.get("num_hidden_layers", 1) * kv_heads * head_dim * dtype.itemsize * max_model_len


def checkpoint_names(path: str) -> List[str]:
    """Parameter names of a safetensors checkpoint, minus a tied lm_head (the engine skips it)."""
    from safetensors import safe_open

    names = []
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt") as fh:
            names.extend(fh.keys())
    if not names:
        raise ValueError(f"model={path!r}: no *.safetensors files in the directory")
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    if cfg.get("tie_word_embeddings"):
        names = [n for n in names if n != "lm_head.weight"]
    return names
