"""fastgrpo.trainer: what trains. The GRPO phases (`grpo`, the update in `update`, the step's
rollout metrics in `step_metrics`), the async trainer (`async_trainer`), the SFT cold start
(`sft`), evaluation, the trainer's side of checkpoints (`resume`: what state is saved and
restored; the run folder itself is `fastgrpo.runs`), LoRA's run glue (`lora_run`), the
data-parallel backends (`backend`) and their collectives, and the builders that turn config
sections into objects (`build`).

`Trainer`, `TrainingStopped` and `seed_everything` resolve lazily, so that importing one of the
light submodules (collectives, build) does not import the trainer's dependencies.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"Trainer": "fastgrpo.trainer.grpo", "TrainingStopped": "fastgrpo.trainer.grpo",
            "seed_everything": "fastgrpo.trainer.grpo"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastgrpo.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
