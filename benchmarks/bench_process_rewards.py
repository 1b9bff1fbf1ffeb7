"""Process rewards on the embedded demo: does a step-level signal change what GRPO learns?

From one noisy SFT cold start per seed (the demo's: carries dropped in 60% of the carry traces,
≈ half of the held-out sums right), GRPO runs `--steps` steps under each reward setting, every
setting from the same weights and seed:

  format          outcome reward = the format reward alone: after SFT nearly every completion is
                  well formed, so nearly every group has σ = 0 and is dropped — the sparse-outcome
                  stall of the RLVR chapter
  format+dense    the same outcome reward plus the dense process advantage (rewards.process:
                  the built-in `arithmetic` scorer on the think and answer steps, w = dense_weight):
                  the answer step's score reaches its own tokens even where every outcome is equal
  accuracy        the demo's rewards (accuracy + 0.1·format)
  accuracy+dense  the demo's rewards plus the dense process advantage

Reported per setting: greedy held-out accuracy (all held-out sums, and those with a carry)
after SFT and after GRPO, and the GRPO wall seconds. Held-out problems are never trained on.

Measured (40 steps, seeds 0 / 1 / 2, greedy held-out accuracy after SFT 0.390 / 0.535 / 0.525 →):
format 0.315 / 0.385 / 0.165, format+dense 0.565 / 0.825 / 0.830, accuracy 0.585 / 0.875 / 0.890,
accuracy+dense 0.585 / 0.850 / 0.885 (README, "Process rewards", has the carry column).

    python -m benchmarks.bench_process_rewards --steps 40          # seeds 0 1 2
    python -m benchmarks.bench_process_rewards --seeds 0 --steps 30
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

SCHEDULE = [
    "sft.steps=450", "rollout.engine=torch", "rollout.prompts_per_step=32", "data.num_heldout=200",
    "eval.max_problems=200", "eval.every=0", "logging.progress=false", "logging.tensorboard=false",
    "logging.plots=false", "checkpoint.every=0", "checkpoint.at_end=false", "checkpoint.resume=none",
]
DENSE = ["rewards.process.scorer=arithmetic", "rewards.process.regex=<think>.*?</think>|<answer>.*?</answer>"]
SETTINGS = {
    "format": ["rewards.functions=[format]", "rewards.weights=[1.0]"],
    "format+dense": ["rewards.functions=[format]", "rewards.weights=[1.0]"] + DENSE,
    "accuracy": [],
    "accuracy+dense": DENSE,
}


def carries(task, problems):
    return [p for p in problems if sum(x % 10 for x in task.operands(p)) >= 10]


def heldout_accuracy(trainer, task, cfg) -> tuple:
    """Greedy accuracy (the task's accuracy reward, whatever the run trains on) on all held-out
    sums and on those with a carry."""
    from fastgrpo.trainer.evaluation import evaluate

    trainer.sync_engine()
    held, acc = list(task.heldout), {"accuracy": task.reward_fns()["accuracy"]}
    every = evaluate(trainer.engine, held, acc, cfg.eval, cfg.rollout)["eval/accuracy"]
    carry = evaluate(trainer.engine, carries(task, held), acc, cfg.eval, cfg.rollout)["eval/accuracy"]
    return every, carry


def run_seed(seed: int, steps: int, weight: float, settings) -> dict:
    import copy

    from fastgrpo.demo.default import default_config
    from fastgrpo.trainer.build import build_model, build_task
    from fastgrpo.trainer.grpo import Trainer, seed_everything
    from fastgrpo.trainer.sft import run_sft

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = default_config(SCHEDULE + [f"seed={seed}", f"steps={steps}"], out_dir=tmp)
        seed_everything(seed)
        model, tok = build_model(base.model)
        task = build_task(base.data)
        run_sft(base, model, tok, task)
        sft_state = copy.deepcopy(model.state_dict())
        for name in settings:
            extra = SETTINGS[name] + ([f"rewards.process.dense_weight={weight}"] if "dense" in name else [])
            cfg = default_config(SCHEDULE + [f"seed={seed}", f"steps={steps}"] + extra, out_dir=f"{tmp}/{name}")
            seed_everything(seed)
            m, _ = build_model(cfg.model)
            m.load_state_dict(sft_state)
            trainer = Trainer(cfg, m, tok, task, log=lambda msg: None)
            try:
                before = heldout_accuracy(trainer, task, cfg)
                seed_everything(seed)
                t0 = time.perf_counter()
                trainer.train()
                wall = time.perf_counter() - t0
                after = heldout_accuracy(trainer, task, cfg)
            finally:
                trainer.close()
            out[name] = {"before": before, "after": after, "wall_s": wall}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--weight", type=float, default=1.0, help="rewards.process.dense_weight of the dense settings")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = {name: [] for name in args.settings}
    print(f"# {args.steps} GRPO steps from the demo's SFT cold start; greedy held-out accuracy all / carry")
    print(f"{'seed':>4} {'setting':<15} {'all: SFT → GRPO':>18} {'carry: SFT → GRPO':>19} {'lift all':>9} {'wall s':>7}")
    for seed in args.seeds:
        res = run_seed(seed, args.steps, args.weight, args.settings)
        for name, r in res.items():
            (b, bc), (a, ac) = r["before"], r["after"]
            rows[name].append(a - b)
            print(f"{seed:>4} {name:<15} {b:>8.3f} → {a:<7.3f} {bc:>9.3f} → {ac:<7.3f} {100 * (a - b):>+8.1f} {r['wall_s']:>7.1f}",
                  flush=True)
    print("# median lift over seeds (points): " + ", ".join(
        f"{name} {100 * statistics.median(v):+.1f}" for name, v in rows.items()))


if __name__ == "__main__":
    main()
