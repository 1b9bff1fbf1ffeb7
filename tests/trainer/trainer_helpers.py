"""Fixtures of the trainer tests: a tiny config (1-layer, hidden 32 model; 10×10 addition
problems; 4 prompts × G=4 per step) and a task whose reward varies across samples even for an
untrained model, so that every step really updates the weights."""

from fastgrpo.config import load_config
from fastgrpo.tasks.arithmetic import ArithmeticTask

TINY = [
    "threads=1", "steps=2", "sft_first=false", "rollout.engine=torch",
    "rewards.functions=[accuracy, format]", "rewards.weights=[1.0, 0.1]", "optimizer.lr=5e-4", "sft.lr=3e-3",
    "model.hidden_size=32", "model.num_hidden_layers=1", "model.intermediate_size=64", "model.num_attention_heads=2",
    "data.max_operand=10", "data.num_heldout=10",
    "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_new_tokens=8",
    "sft.steps=2", "sft.batch_size=8", "eval.max_problems=5",
    "logging.progress=false", "logging.tensorboard=false", "logging.plots=false",
    "checkpoint.every=0", "checkpoint.at_end=false",
]


def tiny_cfg(tmp_path, *extra):
    return load_config(None, TINY + [f"logging.out_dir={tmp_path}"] + list(extra))


class NoisyTask(ArithmeticTask):
    """Arithmetic prompts; 'accuracy' = 1 when the completion holds a digit 1..4 — true for
    some random samples and not others, so groups have σ > 0 and the loss has a gradient.
    `fail_even=True`: the format reward raises for problems with an even answer; `nan=True`:
    the accuracy reward is NaN (so advantages and the loss are NaN)."""

    def __init__(self, fail_even=False, nan=False):
        super().__init__(10, 10, 0)
        self.fail_even = fail_even
        self.nan = nan

    def reward_fns(self):
        def acc(completions, answers):
            return [float("nan") if self.nan else float(any(d in c for d in "1234")) for c in completions]

        def fmt(completions, answers):
            if self.fail_even and any(int(a) % 2 == 0 for a in answers):
                raise RuntimeError("verifier crashed")
            return [0.5] * len(completions)

        return {"accuracy": acc, "format": fmt}


def stale_trainer(cfg_factory, *extra):
    """A Trainer whose engine syncs every 2 steps (its rollouts off-policy in between), large lr;
    returns it and the list each step's packed batches (with problems and groups) are appended to."""
    from fastgrpo.rollout.torch_engine import TorchEngine
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.grpo import Trainer

    cfg = cfg_factory("steps=3", "sync.every=2", "optimizer.lr=0.05", *extra)
    model, tok = build_model(cfg.model)
    t = Trainer(cfg, model, tok, task=NoisyTask(), engine=TorchEngine(model, tok, copy_model=True), log=lambda m: None)
    seen = []
    pack = t._pack

    def capture(problems, groups, adv, keep):
        out = pack(problems, groups, adv, keep)
        seen.append((out, problems, groups))
        return out

    t._pack = capture
    return t, seen
