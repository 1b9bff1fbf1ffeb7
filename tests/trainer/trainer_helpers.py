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
