"""One process of test_lora's DeepSpeed check (run with torchrun's environment): a LoRA policy
under ZeRO-`argv[1]` trains 2 steps (the adapter alone), saves, and a second trainer resumes the
checkpoint; writes what the test compares to argv[2]."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_helpers import TINY, NoisyTask  # noqa: E402

from fastgrpo.config import load_config  # noqa: E402
from fastgrpo.models import lora  # noqa: E402
from fastgrpo.trainer.grpo import Trainer  # noqa: E402


def main(stage: int, out: str) -> None:
    cfg = load_config(None, TINY + ["model.lora.rank=4", "optimizer.lr=5e-3", "distributed.backend=deepspeed",
                                    f"distributed.zero_stage={stage}", f"logging.out_dir={out}/run", "steps=2"])
    t = Trainer(cfg, task=NoisyTask(), log=lambda m: None)
    m = t.backend.module

    def snap():
        return ({k: v.detach().clone() for k, v in lora.adapter_named_tensors(m).items()},
                {k: v.detach().clone() for k, v in m.state_dict().items() if ".lora_" not in k})

    a0, b0 = snap()
    t.train()
    a1, b1 = snap()
    path = t.save()
    t.close()
    r = Trainer(cfg, task=NoisyTask(), log=lambda m: None)
    r.resume(path)
    a2 = {k: v.detach().clone() for k, v in lora.adapter_named_tensors(r.backend.module).items()}
    opt = [p for g in r.backend.optimizer.param_groups for p in g["params"]]
    torch.save({"a0": a0, "a1": a1, "a2": a2, "b0": b0, "b1": b1, "step": r.step_num, "path": path,
                "opt_numel": sum(p.numel() for p in opt), "adapter_numel": sum(v.numel() for v in a2.values())},
               os.path.join(out, "result.pt"))
    r.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
