"""Distributed training on CPU: 2 processes (torchrun, gloo) train 2 GRPO steps and end with
identical weights on both ranks, equal to one process replaying both ranks' rollouts (DeepSpeed
ZeRO-1, 2 and 3, torch DDP); and fastgrpo's Trainer on DeepSpeed ZeRO-2 and ZeRO-3 (in the same
launch) keeps ranks identical, rebalances rollouts, shares the curriculum, skips a NaN step
seen on one rank only, builds its reference model under ZeRO-3 and resumes exactly under ZeRO-2.

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

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dist_worker.py")
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
    from fastgrpo.models.tiny import build_tiny_model

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
    """The Trainer on DeepSpeed ZeRO, 3 steps, NaN on rank 1 only: a gradient at step 1 (ZeRO-2;
    only the reduced ZeRO partitions show it), or the hidden states at step 1 (the zero-weighted
    stand-in loss runs on partitioned parameters) and a gradient at step 2 (ZeRO-3). Weights
    changed, finite and identical on both ranks; every poisoned step skipped on both ranks."""
    d, _ = runs
    r0, r1 = (torch.load(d / f"trainer_{stage}_adamw_rank{r}.pt", weights_only=False) for r in (0, 1))
    w0, w1 = r0["w"], r1["w"]
    assert torch.equal(w0, w1), f"ranks diverged: max |Δ| = {(w0 - w1).abs().max():.3g}"
    assert torch.isfinite(w0).all(), "a NaN gradient was applied"
    assert (w0 - r0["w0"]).abs().max() > 1e-4, "the trainer did not change the weights"
    poisoned = 1 if stage == 2 else 2
    assert r0["nan_skips"] == r1["nan_skips"] == poisoned, "a poisoned step was not skipped on every rank"
    inner = 2 if stage == 3 else 1  # ZeRO-3 runs K = 2 inner steps per trainer step
    applied = (3 - poisoned) * inner
    assert r0["steps"] == r1["steps"] == applied, f"DeepSpeed applied {r0['steps']} steps, expected {applied}"
    # oneDNN linears (fastgrpo.models.onednn) where enabled, except under ZeRO-3 (partitioned weights)
    from fastgrpo.models.onednn import onednn_enabled

    assert (r0["fast_linears"] > 0) == (onednn_enabled() and stage != 3)
    # fused decoder layers (fastgrpo.models.fused_layer) likewise: ZeRO-3 gathers weights in hooks they skip
    assert (r0["fused_layers"] > 0) == (stage != 3)


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_rebalances_and_shares_curriculum(runs, stage):
    """3 prompts × G=4 on 2 ranks: the prompt shards hold 4 and 8 sequences; after the
    rebalance each rank trains on 6. Every rank updates its curriculum with all ranks' results,
    so the curricula (and with them the shared-seed samplers) stay identical."""
    d, _ = runs
    r0, r1 = (torch.load(d / f"trainer_{stage}_adamw_rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["seqs"] == r1["seqs"] == [6, 6, 6], f"sequences per step: rank 0 {r0['seqs']}, rank 1 {r1['seqs']}"
    assert r0["curriculum"] == r1["curriculum"], "the ranks' curricula drifted apart"
    attempts = sum(a for a, *_ in r0["curriculum"]["stats"])
    assert attempts == 3 * 3 * 4, f"curriculum saw {attempts} results, expected 3 steps × 3 prompts × G=4"


def test_trainer_zero3_reference_model_holds_initial_weights(runs):
    """β > 0 under ZeRO-3: the reference model is built from the gathered weights (a deepcopy of
    partitioned parameters holds 0-element shards)."""
    d, _ = runs
    r = torch.load(d / "trainer_3_adamw_rank1.pt", weights_only=False)
    assert torch.equal(r["ref"], r["w0"]), "the reference model does not hold the initial weights"


def test_trainer_zero2_checkpoint_resume_is_exact(runs):
    """ZeRO-2: checkpoints hold every rank's optimizer partition (DeepSpeed's layout under
    engine/) and RNG state inside the atomic step directory; a Trainer resumed from step 2 ends
    step 3 with exactly the weights of the uninterrupted run, on both ranks."""
    d, _ = runs
    for rank in (0, 1):
        r = torch.load(d / f"trainer_2_adamw_rank{rank}.pt", weights_only=False)
        assert torch.equal(r["w_resumed"], r["w"]), \
            f"rank {rank}: resumed run differs by {(r['w_resumed'] - r['w']).abs().max():.3g}"
    step = d / "trainer2" / "checkpoints" / "step-00000003"
    optim = sorted(p.name for p in (step / "engine" / "state").iterdir() if "optim_states" in p.name)
    assert len(optim) == 2, f"expected one optimizer partition per rank, found {optim}"
    assert (step / "rng-rank0.pt").exists() and (step / "rng-rank1.pt").exists()
    leftovers = [p.name for p in (d / "trainer2" / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert not leftovers, f"temp directories left behind: {leftovers}"
