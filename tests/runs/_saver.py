"""Child process of test_checkpoint: saves checkpoints until it is killed. Every weight of the
model saved as step k equals k, so a loaded checkpoint can be checked for tearing.

argv: out_dir mode, mode = "loop" (save forever; the parent kills at a random moment) or one
of the kill points below, where the process SIGKILLs itself in the middle of saving step 3:
"state" (state.pt half written), "rename" (temp dir complete, not yet renamed), "prune" (the
old checkpoint renamed to trash, not yet deleted)."""
import os
import shutil
import signal
import sys

import torch

from fastgrpo.runs import checkpoint as ckpt


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def arm(mode):
    if mode == "state":
        real = ckpt.torch_save  # the checkpoint's one torch writer (through a Python file)

        def half_save(obj, path):
            if str(path).endswith("state.pt"):
                with open(path, "wb") as f:
                    f.write(b"\x80" * 1000)
                    f.flush()
                die()
            return real(obj, path)

        ckpt.torch_save = half_save
    elif mode == "rename":
        ckpt._fsync_dir = lambda path: die()
    elif mode == "prune":
        real_rmtree = shutil.rmtree
        shutil.rmtree = lambda path, ignore_errors=False: die() if ".tmp-trash" in path else real_rmtree(path, ignore_errors)


def main(out, mode):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    big = torch.zeros(2_000_000)  # ~8 MB of extra state: a save takes long enough to be hit mid-write
    print("ready", flush=True)
    for step in range(1, 100000):
        if step == 3 and mode != "loop":
            arm(mode)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        ckpt.save_checkpoint(out, step, model, opt, extra={"big": big + step}, keep_last=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
