"""The trainer's side of the distributed backend, in one process: the skip path drops gradients
through `backend.discard_gradients()` and asks the backend whether its gradients are finite
(under ZeRO they are not in `p.grad`); the zero-weighted stand-in loss reuses the graph already
built; checkpoints take per-rank shards inside the atomic rename; the CLI ignores the
`--local_rank` of the deepspeed launcher and prints only on rank 0. The multi-rank behaviour is
checked by the 2-rank launch in tests/distributed/test_distributed.py."""
import os

import pytest
import torch
from trainer_helpers import NoisyTask

from fastgrpo.runs import checkpoint as ckpt
from fastgrpo import cli
from fastgrpo.trainer.backend import zero_weighted_loss
from fastgrpo.trainer.grpo import Trainer


def _state(t):
    return {k: v.clone() for k, v in t.backend.module.state_dict().items()}


def test_nan_step_discards_gradients_through_the_backend(cfg_factory):
    t = Trainer(cfg_factory("steps=2"), task=NoisyTask(), log=lambda m: None)
    calls = []
    real = t.backend.discard_gradients
    t.backend.discard_gradients = lambda: (calls.append(1), real())[1]
    t.backend.module.model.norm.register_forward_hook(lambda m, a, out: out * float("nan") if m.training else out)
    before = _state(t)
    logs = t.step()
    assert logs["train/skipped"] == 1.0 and calls == [1]
    assert all(torch.equal(v, before[k]) for k, v in t.backend.module.state_dict().items())
    t.close()


def test_gradient_check_asks_the_backend(cfg_factory):
    """Under ZeRO `p.grad` is None after the reduction: the trainer must use the backend's own
    check (here forced to report a non-finite partition) and skip."""
    t = Trainer(cfg_factory("steps=2"), task=NoisyTask(), log=lambda m: None)
    t.backend.local_grads_finite = lambda: False
    before = _state(t)
    logs = t.step()
    assert logs["train/skipped"] == 1.0 and t.nan_skips == 1
    assert all(torch.equal(v, before[k]) for k, v in t.backend.module.state_dict().items())
    t.close()


def test_step_that_refuses_an_overflowing_norm_counts_as_skipped(cfg_factory):
    """Finite gradients whose global norm overflows: `backend.step()` applies nothing and says so
    through `last_step_skipped`; the trainer must count and report the skip like a NaN."""
    t = Trainer(cfg_factory("steps=2"), task=NoisyTask(), log=lambda m: None)
    real = t.backend.step

    def refusing_step(accept=None):
        t.backend.discard_gradients()
        t.backend.last_step_skipped = True
        return float("inf")

    t.backend.step = refusing_step
    before = _state(t)
    logs = t.step()
    assert logs["train/skipped"] == 1.0 and t.nan_skips == 1
    assert all(torch.equal(v, before[k]) for k, v in t.backend.module.state_dict().items())
    t.backend.step = real
    t.backend.last_step_skipped = False
    logs = t.step()
    assert "train/skipped" not in logs and t.nan_skips == 1
    t.close()


def test_zero_loss_reaches_every_parameter_with_zero_gradient(cfg_factory):
    t = Trainer(cfg_factory("steps=1"), task=NoisyTask(), log=lambda m: None)
    model = t.backend.module
    hidden = model.model(input_ids=torch.tensor([[5, 6, 7]])).last_hidden_state[0]
    loss = zero_weighted_loss(model, hidden)
    assert loss.item() == 0.0
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n} not reached: its gradient reduction would be skipped on this rank"
        assert not p.grad.any(), f"{n} got a non-zero gradient"
    t.close()


def test_checkpoint_shards_are_inside_the_atomic_rename(tmp_path):
    model = torch.nn.Linear(4, 4)
    out = str(tmp_path)
    first = ckpt.save_checkpoint(out, 1, model, keep_last=5)
    seen = []

    def shards(tmp):
        seen.append(tmp)
        assert os.path.basename(tmp).startswith(".tmp-") and not os.path.exists(os.path.join(tmp, "meta.json"))
        torch.save({"part": 0}, os.path.join(tmp, "rng-rank0.pt"))

    path = ckpt.save_checkpoint(out, 2, model, shards=shards, keep_last=5)
    assert seen and os.path.exists(os.path.join(path, "rng-rank0.pt"))

    def dies(tmp):
        raise RuntimeError("rank 1 died while writing its shard")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        ckpt.save_checkpoint(out, 3, model, shards=dies, keep_last=1)
    assert ckpt.list_checkpoints(out) == [first, path], "a failed save must not touch complete checkpoints"
    assert not [n for n in os.listdir(ckpt.ckpt_root(out)) if n.startswith(".tmp-")], "partial temp dir left"


def test_strip_local_rank():
    assert cli.strip_local_rank(["--local_rank=1", "train", "--out", "x"]) == ["train", "--out", "x"]
    assert cli.strip_local_rank(["train", "--local-rank", "0", "--set", "a.b=1"]) == ["train", "--set", "a.b=1"]


@pytest.mark.parametrize("rank,printed", [("0", True), ("1", False)])
def test_cli_local_rank_ignored_and_only_rank0_prints(monkeypatch, capsys, rank, printed):
    """The deepspeed launcher runs `fastgrpo --local_rank=N train …`; a bad override must still
    be reported as such (exit 2), once, by rank 0."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["--local_rank=" + rank, "train", "--set", "optimizer.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert ("optimizer.lrr" in err) == printed, err
