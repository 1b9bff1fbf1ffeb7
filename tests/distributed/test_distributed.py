"""Distributed training on CPU: 2 processes (torchrun, gloo) train 2 GRPO steps and end with
identical weights on both ranks, equal to one process replaying both ranks' rollouts (DeepSpeed
ZeRO-1, 2 and 3, torch DDP); and fastgrpo's Trainer on DeepSpeed ZeRO-2 and ZeRO-3 does the same.

Each launch runs under a hard timeout and is killed as a process group, so a hung collective
can never hang CI.
"""
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.deepspeed

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, out_dir, nproc=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", WORKER]
    else:
        cmd = [sys.executable, WORKER]
    proc = subprocess.Popen(cmd + ["--out", str(out_dir)] + args, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {TIMEOUT_S} s:\n{log[-3000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd + args)} failed:\n{log[-4000:]}"
    return log


CONFIGS = [  # backend, ZeRO stage, optimizer, tolerance against the 1-process replay
    # SGD is linear in the gradient: a wrong 1/world scale, or gradients left over from the
    # discarded (skipped) pass the worker runs first, show in the weights
    ("deepspeed", 2, "sgd", 1e-6),
    ("deepspeed", 3, "sgd", 1e-6),
    ("ddp", 0, "sgd", 1e-6),
    # AdamW as users run it; Adam divides by √v, so reduction-order noise on tiny grads shows
    ("deepspeed", 1, "adamw", 1e-4),
]
# fastgrpo's Trainer itself (distributed.backend=deepspeed, ZeRO-2 and ZeRO-3), in the same launch
SPEC = ",".join(f"{b}:{s}:{o}" for b, s, o, _ in CONFIGS) + ",trainer:2:adamw,trainer:3:adamw"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank launch training every config in turn, and one process replaying both ranks'
    rollouts (one launch each: process start-up, not training, dominates on CPU)."""
    d = tmp_path_factory.mktemp("dist")
    log = _run(["--configs", SPEC, "--steps", "2"], d, nproc=2)
    _run(["--configs", SPEC, "--steps", "2", "--reference-ranks", "2"], d)
    return d, log


def _initial_weights():
    from fastgrpo.demo.tiny import build_tiny_model

    model, _ = build_tiny_model(seed=0)
    return torch.cat([v.flatten().float() for _, v in sorted(model.state_dict().items())])


@pytest.mark.parametrize("backend,stage,opt,tol", CONFIGS)
def test_two_ranks_identical_weights(runs, backend, stage, opt, tol):
    d, _ = runs
    r0, r1 = (torch.load(d / f"{backend}_{stage}_{opt}_rank{r}.pt") for r in (0, 1))
    w0, w1 = r0["w"], r1["w"]
    assert torch.equal(w0, w1), f"ranks diverged: max |Δ| = {(w0 - w1).abs().max():.3g}"
    assert (w0 - _initial_weights()).abs().max() > 1e-3, "weights did not change"
    err = (w0 - torch.load(d / f"reference_{opt}.pt")).abs().max().item()
    assert err <= tol, f"2-rank {backend} ZeRO-{stage} differs from the 1-process replay by {err:.3g} > {tol}"
    # the rebalanced batch is split into the same number (> 1: accumulation runs) of micro-batches
    assert r0["micro"] == r1["micro"] > 1


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_two_ranks_identical_weights(runs, stage):
    """The Trainer on DeepSpeed ZeRO: 2 steps, weights changed and identical on both ranks."""
    d, _ = runs
    r0, r1 = (torch.load(d / f"trainer_{stage}_adamw_rank{r}.pt") for r in (0, 1))
    w0, w1 = r0["w"], r1["w"]
    assert torch.equal(w0, w1), f"ranks diverged: max |Δ| = {(w0 - w1).abs().max():.3g}"
    assert (w0 - _initial_weights()).abs().max() > 1e-4, "the trainer did not change the weights"
    assert r0["steps"] == r1["steps"] == 2, "DeepSpeed did not apply 2 optimizer steps"
