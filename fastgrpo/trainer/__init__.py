"""fastgrpo.trainer: the GRPO phases (`grpo`), the SFT cold start (`sft`), evaluation, checkpoints
(`checkpoint`, `resume`), metrics, the data-parallel backend (`backend`) and its collectives,
and the builders that turn config sections into objects (`build`).

`Trainer`, `TrainingStopped` and `seed_everything` resolve lazily, so that importing one of the
light submodules (collectives, checkpoint) does not import the trainer's dependencies.
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
