"""One trainer rank of test_async_ranks.py (launched by torchrun, gloo, DDP): AsyncTrainer with
rollout workers driven by rank 0; writes this rank's final weights and per-step metrics to
<out>/rank<r>.pt."""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "trainer")]

from async_helpers import async_cfg  # noqa: E402
from trainer_helpers import NoisyTask  # noqa: E402


def main(out: str) -> None:
    from fastgrpo.trainer.async_trainer import AsyncTrainer
    from fastgrpo.trainer.backend import shutdown
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.grpo import seed_everything

    cfg = async_cfg(out, "distributed.backend=ddp", "rollout.max_staleness=1", "steps=3", "rollout.prompts_per_step=4",
                    "cluster.num_cpus=1")
    seed_everything(cfg.seed)
    model, tok = build_model(cfg.model)
    tr = AsyncTrainer(cfg, model, tok, NoisyTask(), log=lambda m: None)
    try:
        logs = [tr.step() for _ in range(cfg.steps)]
        flat = torch.cat([p.detach().reshape(-1) for p in tr.backend.module.parameters()])
        torch.save({"weights": flat, "logs": logs, "rank": tr.rank, "world": tr.world_size,
                    "trained": tr.trained_indices}, os.path.join(out, f"rank{tr.rank}.pt"))
    finally:
        tr.close()
        shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
