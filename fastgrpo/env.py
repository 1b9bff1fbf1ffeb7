"""Every environment knob of fastgrpo, read in this one module (house style rule 9).

All knobs carry the `FASTGRPO_` prefix. They are read at import time of the module that needs
them through the accessors below, so a test can set them with monkeypatch before calling.
"""
from __future__ import annotations

import os


def _flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0/true/false/yes/no/on/off")


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def disable_ext() -> bool:
    """FASTGRPO_DISABLE_EXT=1: ignore the compiled fastgrpo._C and use the Python twins."""
    return _flag("FASTGRPO_DISABLE_EXT")


def native_decode() -> bool:
    """FASTGRPO_NATIVE_DECODE=0: the built-in engine keeps LeanStepper's Python step, the HF
    prefill and the Python sampler (`_decode.pick`) instead of the JIT-built native step, prefill
    and sampler (csrc/jit/decode_step.cpp + sampler.cpp; default on)."""
    return _flag("FASTGRPO_NATIVE_DECODE", True)


def fused_layers() -> bool:
    """FASTGRPO_FUSED_LAYERS=0: packed float32 CPU training forwards keep the model's own decoder
    layers instead of the fused ones (fastgrpo/models/fused_layer.py, csrc/jit/train_ops.cpp; default on)."""
    return _flag("FASTGRPO_FUSED_LAYERS", True)


def malloc_tune() -> bool:
    """FASTGRPO_MALLOC_TUNE=0: leave glibc malloc's mmap / trim thresholds as they are instead of
    keeping freed activation buffers for reuse (fastgrpo/native/allocator.py; default on)."""
    return _flag("FASTGRPO_MALLOC_TUNE", True)


def ninja_on_path() -> None:
    """torch.utils.cpp_extension runs `ninja` from PATH. Put the `ninja` wheel's binary (the
    project's dependency, in a venv's bin/) first, always: a system ninja of another version
    found first on some PATHs and not on others (`.venv/bin/python -m pytest` vs an activated
    venv) reads the other's .ninja_log as changed commands and rebuilds the extensions every time
    the two alternate (seen: 1.11 in /usr/bin vs the wheel's 1.13, a 2-minute rebuild per run)."""
    import shutil
    import sys

    try:
        import ninja

        folder = ninja.BIN_DIR
    except (ImportError, AttributeError):
        folder = os.path.dirname(sys.executable)
    binary = os.path.join(folder, "ninja")
    if not os.path.isfile(binary):
        return  # no wheel ninja: whatever PATH has (torch says so when there is none)
    found = shutil.which("ninja")
    if found is None or os.path.realpath(found) != os.path.realpath(binary):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def ext_dir() -> str:
    """FASTGRPO_EXT_DIR: where JIT-built extensions go (default ~/.cache/fastgrpo/ext)."""
    return os.environ.get("FASTGRPO_EXT_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fastgrpo", "ext")


_CPU_GEMM_MODES = ("auto", "onednn", "mkl", "off")


def cpu_gemm() -> str:
    """FASTGRPO_CPU_GEMM: float32 CPU linears on oneDNN — auto (default: AMD CPUs where PyTorch
    runs AVX-512 kernels), onednn (wherever the op exists), mkl / off (never); see fastgrpo.models.onednn."""
    raw = (os.environ.get("FASTGRPO_CPU_GEMM") or "auto").strip().lower()
    if raw not in _CPU_GEMM_MODES:
        raise ValueError(f"FASTGRPO_CPU_GEMM={raw!r}: expected one of {', '.join(_CPU_GEMM_MODES)}")
    return raw


def check_finite() -> bool:
    """FASTGRPO_CHECK_FINITE=0 turns off the NaN/Inf check on logits (default on)."""
    return _flag("FASTGRPO_CHECK_FINITE", True)


def vocab_chunk() -> int:
    """FASTGRPO_VOCAB_CHUNK: vocabulary chunk of the CPU streaming path (default 8192 columns)."""
    return _int("FASTGRPO_VOCAB_CHUNK", 8192)


def nvtx_enabled() -> bool:
    """FASTGRPO_NVTX=1: emit NVTX ranges (also switched on by `fastgrpo --nvtx`)."""
    return _flag("FASTGRPO_NVTX")


def triton_interpret() -> bool:
    """TRITON_INTERPRET is Triton's own knob; read here so the rest of the code asks one place."""
    return _flag("TRITON_INTERPRET")


def launcher_ranks() -> tuple:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as set by torchrun / deepspeed: the launchers' protocol,
    not fastgrpo knobs, but read here so every environment read lives in one module."""
    def read(name: str, default: int) -> int:
        raw = os.environ.get(name, "")
        try:
            return int(raw) if raw else default
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected an integer (set by torchrun / deepspeed)") from None

    return read("RANK", 0), read("WORLD_SIZE", 1), read("LOCAL_RANK", 0)


def apply_vllm_defaults() -> None:
    """vLLM reads its own knobs when it is imported: keep the engine core in this process so
    collective_rpc reaches the worker directly, and log warnings only (its INFO line per request
    would drown the trainer's progress bar). A value the user set wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
