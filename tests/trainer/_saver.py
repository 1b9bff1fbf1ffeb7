"""Child process of test_checkpoint: saves checkpoints in a loop until killed. Every weight of
the model saved as step k equals k, so a loaded checkpoint can be checked for tearing."""
import sys

import torch

from fastgrpo.checkpoint import save_checkpoint


def main(out):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    big = torch.zeros(2_000_000)  # ~8 MB of extra state: a save takes long enough to be hit mid-write
    print("ready", flush=True)
    for step in range(1, 100000):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        save_checkpoint(out, step, model, opt, extra={"big": big + step}, keep_last=2)


if __name__ == "__main__":
    main(sys.argv[1])
