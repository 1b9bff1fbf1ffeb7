"""fastgrpo: a GRPO / RLVR training engine whose hot paths are fused kernels.

The public names are imported lazily so that `import fastgrpo` stays cheap (no transformers,
no vLLM, no Triton until used).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LossConfig": "fastgrpo.loss",
    "LossOutput": "fastgrpo.loss",
    "grpo_loss": "fastgrpo.loss",
    "token_logprobs": "fastgrpo.loss",
    "fused_linear_grpo_loss": "fastgrpo.loss",
    "compute_advantages": "fastgrpo.advantages",
    "zero_std_groups": "fastgrpo.advantages",
    "trl_loss_config": "fastgrpo.integrations.trl_config",
    "broadcast_to_tokens": "fastgrpo.advantages",
    "pack_sequences": "fastgrpo.packing",
    "balance_partitions": "fastgrpo.packing",
    "PackedBatch": "fastgrpo.packing",
    "build_packed_batches": "fastgrpo.packing",
    "unpack": "fastgrpo.packing",
    "packed_forward": "fastgrpo.models.packed",
    "packed_logits": "fastgrpo.models.packed",
    "packed_logprobs": "fastgrpo.models.packed",
    "RewardManager": "fastgrpo.rewards",
    "RewardPool": "fastgrpo.rewards",
    "combine_rewards": "fastgrpo.rewards",
    "Curriculum": "fastgrpo.curriculum",
    "RolloutEngine": "fastgrpo.rollout",
    "SamplingConfig": "fastgrpo.rollout",
    "Completion": "fastgrpo.rollout",
    "make_engine": "fastgrpo.rollout",
    "TrainConfig": "fastgrpo.config",
    "load_config": "fastgrpo.config",
    "Trainer": "fastgrpo.trainer",
    "TrainingStopped": "fastgrpo.trainer",
    "run_train": "fastgrpo.pipeline",
    "run_default": "fastgrpo.demo",
    "DistributedBackend": "fastgrpo.trainer.backend",
    "FastGRPOTrainer": "fastgrpo.integrations.trl",
    "patch_trl_loss": "fastgrpo.integrations.trl",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastgrpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
