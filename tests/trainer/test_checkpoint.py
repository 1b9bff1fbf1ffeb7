"""Checkpoints: atomic (kill -9 at any moment leaves a loadable previous checkpoint), pruning
keeps the newest, and a run resumed from step k ends with the same weights as an uninterrupted
run."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastgrpo.trainer import checkpoint as ckpt
from fastgrpo.trainer.grpo import Trainer

from trainer_helpers import NoisyTask


def _check_all_complete_load(out):
    complete = ckpt.list_checkpoints(out)
    assert complete, f"no complete checkpoint left; found {os.listdir(ckpt.ckpt_root(out))}"
    for path in complete:  # every directory that looks complete must load, untorn
        model = torch.nn.Linear(256, 256)
        state = ckpt.load_checkpoint(path, model, restore_rng=False)
        step = state["step"]
        assert torch.all(model.weight == step) and torch.all(state["extra"]["big"] == step), path
    return complete


@pytest.mark.parametrize("mode", ["loop", "state", "rename", "prune"])
def test_kill9_mid_save_leaves_loadable_checkpoint(tmp_path, mode):
    out = str(tmp_path / "run")
    saver = os.path.join(os.path.dirname(__file__), "_saver.py")
    proc = subprocess.Popen([sys.executable, saver, out, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    if mode == "loop":
        time.sleep(1.0)  # a random moment: usually inside a save, since saving is all it does
        os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    complete = _check_all_complete_load(out)
    if mode != "loop":
        # killed while writing step 3: step 2 (keep_last=1) must be the survivor
        assert os.path.basename(complete[-1]) == ("step-00000003" if mode == "prune" else "step-00000002")
    # the next save cleans the dead writer's temp / trash directories and prunes
    ckpt.save_checkpoint(out, 10 ** 6, torch.nn.Linear(2, 2), keep_last=1)
    assert os.listdir(ckpt.ckpt_root(out)) == ["step-01000000"]


def test_prune_keeps_last_k_and_ignores_incomplete(tmp_path):
    out = str(tmp_path)
    m = torch.nn.Linear(3, 3)
    for s in range(1, 6):
        ckpt.save_checkpoint(out, s, m, keep_last=2)
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(out)] == ["step-00000004", "step-00000005"]
    os.makedirs(os.path.join(ckpt.ckpt_root(out), "step-00000009"))  # torn by hand: no meta.json
    assert ckpt.latest_checkpoint(out).endswith("step-00000005")
    ckpt.save_checkpoint(out, 5, m, keep_last=2)  # re-saving a step replaces it
    assert ckpt.latest_checkpoint(out).endswith("step-00000005")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # exited and reaped: no process has this pid now (pids are not reused at once)


def test_resave_killed_between_its_renames_loses_nothing(tmp_path):
    """A re-save of step N swaps the old copy out (step-N.old-<pid>) before renaming the new
    one in; killed in between, step N exists only as the old copy. It is listed (resume finds
    it), and the next save puts it back in place; an old copy whose swap completed is removed."""
    out = str(tmp_path)
    root = ckpt.ckpt_root(out)
    m = torch.nn.Linear(3, 3)
    with torch.no_grad():
        m.weight.fill_(4.0)
    ckpt.save_checkpoint(out, 4, m, keep_last=3)
    ckpt.save_checkpoint(out, 5, m, keep_last=3)
    pid = _dead_pid()
    os.rename(os.path.join(root, "step-00000005"), os.path.join(root, f"step-00000005.old-{pid}"))
    latest = ckpt.latest_checkpoint(out)
    assert latest.endswith(f"step-00000005.old-{pid}")
    back = torch.nn.Linear(3, 3)
    assert ckpt.load_checkpoint(latest, back, restore_rng=False)["step"] == 5 and torch.all(back.weight == 4.0)
    ckpt.save_checkpoint(out, 6, m, keep_last=3)
    assert sorted(os.listdir(root)) == ["step-00000004", "step-00000005", "step-00000006"]
    # a stray old copy beside its replaced step (killed after both renames) is deleted
    shutil.copytree(os.path.join(root, "step-00000006"), os.path.join(root, f"step-00000006.old-{pid}"))
    assert ckpt.latest_checkpoint(out).endswith("step-00000006")
    ckpt.save_checkpoint(out, 7, m, keep_last=3)
    assert sorted(os.listdir(root)) == ["step-00000005", "step-00000006", "step-00000007"]


def test_swapped_out_copy_with_a_reused_or_live_pid(tmp_path):
    """A restarted process can get the pid of the one that died mid-swap, or an unrelated live
    process can hold it: the swapped-out copy is listed either way; our own pid's copy is put
    back at the next save, and re-saving that step twice in a row works."""
    out = str(tmp_path)
    root = ckpt.ckpt_root(out)
    m = torch.nn.Linear(3, 3)
    ckpt.save_checkpoint(out, 1, m, keep_last=3)
    ckpt.save_checkpoint(out, 2, m, keep_last=3)
    own = os.path.join(root, f"step-00000002.old-{os.getpid()}")
    os.rename(os.path.join(root, "step-00000002"), own)
    assert ckpt.latest_checkpoint(out) == own
    ckpt.save_checkpoint(out, 3, m, keep_last=3)     # recovers our own pid's copy
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002", "step-00000003"]
    ckpt.save_checkpoint(out, 3, m, keep_last=3)     # re-save twice: the name is cleared first
    ckpt.save_checkpoint(out, 3, m, keep_last=3)
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002", "step-00000003"]
    live = os.getppid()                               # a live process that is not us
    other = os.path.join(root, f"step-00000003.old-{live}")
    os.rename(os.path.join(root, "step-00000003"), other)
    assert ckpt.latest_checkpoint(out) == other       # listed: it is the step's only copy
    ckpt.save_checkpoint(out, 4, m, keep_last=5)      # not touched while its pid lives
    assert os.path.isdir(other) and ckpt.list_checkpoints(out)[-2] == other


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.backend.module.state_dict().items()}


def test_resume_continues_exactly(cfg_factory, tmp_path):
    cfg_a = cfg_factory("steps=4", f"logging.out_dir={tmp_path / 'a'}", "algorithm.inner_steps=2",
                        "optimizer.schedule=cosine")
    a = Trainer(cfg_a, task=NoisyTask(), log=lambda m: None)
    a.train()
    wa = _weights(a)
    a.close()

    cfg_b = cfg_factory("steps=4", f"logging.out_dir={tmp_path / 'b'}", "algorithm.inner_steps=2",
                        "optimizer.schedule=cosine")
    b = Trainer(cfg_b, task=NoisyTask(), log=lambda m: None)
    b.step()
    b.step()
    path = b.save()
    b.close()
    del b
    c = Trainer(cfg_b, task=NoisyTask(), log=lambda m: None)
    assert c.maybe_resume() == path and c.step_num == 2
    c.train()
    wc = _weights(c)
    c.close()
    init = Trainer(cfg_factory(f"logging.out_dir={tmp_path / 'c'}"), task=NoisyTask(), log=lambda m: None)
    w0 = _weights(init)
    init.close()
    assert any(not torch.equal(w0[k], wa[k]) for k in wa), "training never changed the weights: test is vacuous"
    for k in wa:
        assert torch.equal(wa[k], wc[k]), f"{k} differs between the uninterrupted and the resumed run"


def test_resume_from_a_checkpoint_with_sharded_weights(tmp_path):
    """save_pretrained shards a model over its max_shard_size (any 30B+ model): loading must
    merge the shards listed in model.safetensors.index.json."""
    import functools

    from fastgrpo.trainer import checkpoint as ckpt_mod
    from fastgrpo.models.tiny import build_tiny_model

    model, _ = build_tiny_model("llama", seed=0)
    model.save_pretrained = functools.partial(type(model).save_pretrained, model, max_shard_size="20KB")
    path = ckpt_mod.save_checkpoint(str(tmp_path), 3, model)
    files = os.listdir(os.path.join(path, "model"))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    fresh, _ = build_tiny_model("llama", seed=1)
    ckpt_mod.load_checkpoint(path, model=fresh, restore_rng=False)
    want = model.state_dict()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_resume_with_an_engine_behind_the_policy_continues_exactly(cfg_factory, tmp_path):
    """sync.every = 2 with an engine of its own (a copy): a periodic checkpoint due at a step
    whose engine is behind waits for the next synced step, so a run killed at step 3 resumes from
    step 2 and ends with the weights of an uninterrupted run; an explicit save while stale is
    marked and reported at resume."""
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.checkpoint import list_checkpoints
    from fastgrpo.rollout.torch_engine import TorchEngine

    def make(out, *extra):
        cfg = cfg_factory("steps=5", "sync.every=2", "checkpoint.every=1", "checkpoint.keep_last=5",
                          "optimizer.lr=0.05", f"logging.out_dir={tmp_path / out}", *extra)
        model, tok = build_model(cfg.model)
        msgs = []
        t = Trainer(cfg, model, tok, task=NoisyTask(), engine=TorchEngine(model, tok, copy_model=True),
                    log=msgs.append)
        return t, msgs

    a, _ = make("a")
    a.train()
    wa = _weights(a)
    steps = sorted(int(p.rsplit("-", 1)[1]) for p in list_checkpoints(str(tmp_path / "a")))
    a.close()
    assert steps == [2, 4]  # due at every step; 1, 3 and 5 ended behind the policy

    b, _ = make("b")
    for _ in range(3):
        b.step()  # "killed" after step 3: its due checkpoint was still waiting for a sync
    b.close()
    c, msgs = make("b")
    assert c.maybe_resume().endswith("step-00000002") and c.step_num == 2
    c.train()
    wc = _weights(c)
    c.close()
    for k in wa:
        assert torch.equal(wa[k], wc[k]), f"{k} differs between the uninterrupted and the resumed run"
    assert not any("behind the policy" in m for m in msgs)

    d, _ = make("d")
    d.step()
    stale_path = d.save()  # explicit save between two syncs
    d.close()
    e, msgs = make("d")
    assert e.maybe_resume() == stale_path
    assert any("behind the policy" in m for m in msgs)
    e.close()
