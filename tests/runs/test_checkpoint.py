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

from fastgrpo.runs import checkpoint as ckpt
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

    from fastgrpo.runs import checkpoint as ckpt_mod
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
    from fastgrpo.runs.checkpoint import list_checkpoints
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


# -- integrity: checksums written last, verified on load, fallback to the newest intact one --

def _three_checkpoints(out):
    m = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for s in (1, 2, 3):
        with torch.no_grad():
            m.weight.fill_(float(s))
        ckpt.save_checkpoint(out, s, m, opt, extra={"big": torch.full((1000,), float(s))}, keep_last=5)
    return ckpt.list_checkpoints(out)


def _flip(path, at=None):
    with open(path, "r+b") as f:
        size = os.path.getsize(path)
        f.seek(size // 2 if at is None else at)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage", ["flip model.pt", "flip state.pt", "truncate state.pt", "truncate model.pt",
                                    "delete checksums.json", "flip checksums.json"])
def test_damaged_latest_checkpoint_falls_back_naming_the_file(tmp_path, damage):
    out = str(tmp_path)
    paths = _three_checkpoints(out)
    how, name = damage.split()
    target = os.path.join(paths[-1], "model", name) if name == "model.pt" else os.path.join(paths[-1], name)
    {"flip": _flip, "truncate": _truncate, "delete": os.remove}[how](target)
    msgs = []
    assert ckpt.latest_checkpoint(out, log=msgs.append) == paths[-2]
    # a flipped byte in checksums.json itself breaks its JSON or one digest: either file is named
    named = ("checksums.json", "state.pt", "model.pt", "meta.json") if damage == "flip checksums.json" else (name,)
    assert len(msgs) == 1 and "step-00000003" in msgs[0] and "skipped" in msgs[0], msgs
    assert any(n in msgs[0] for n in named), msgs
    with pytest.raises(ckpt.CheckpointError, match="|".join(n.replace(".", r"\.") for n in named)):
        ckpt.load_checkpoint(paths[-1], torch.nn.Linear(16, 16), restore_rng=False)
    back = torch.nn.Linear(16, 16)
    assert ckpt.load_checkpoint(paths[-2], back, restore_rng=False)["step"] == 2 and torch.all(back.weight == 2.0)


def test_flipped_byte_in_model_safetensors_is_caught(tmp_path):
    from fastgrpo.models.tiny import build_tiny_model

    model, _ = build_tiny_model("llama", seed=0)
    out = str(tmp_path)
    first = ckpt.save_checkpoint(out, 1, model, keep_last=3)
    second = ckpt.save_checkpoint(out, 2, model, keep_last=3)
    st = os.path.join(second, "model", "model.safetensors")
    _flip(st, at=os.path.getsize(st) - 7)  # inside the tensor data: safetensors itself loads it happily
    from safetensors.torch import load_file

    load_file(st)  # the control: without checksums this damage is silent
    msgs = []
    assert ckpt.latest_checkpoint(out, log=msgs.append) == first
    assert "model.safetensors" in msgs[0] and "sha256" in msgs[0], msgs
    fresh, _ = build_tiny_model("llama", seed=1)
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors"):
        ckpt.load_checkpoint(second, fresh, restore_rng=False)


def test_load_errors_name_the_file(tmp_path):
    """Without checksums (a checkpoint of an older version) a torn file still fails with its
    name, and is skipped by latest_checkpoint."""
    out = str(tmp_path)
    paths = _three_checkpoints(out)
    for s, p in enumerate(paths, 1):  # as an older version wrote them: format 1, no checksums
        os.remove(os.path.join(p, ckpt.CHECKSUMS))
        with open(os.path.join(p, "meta.json"), "w") as f:
            f.write('{"step": %d, "format": 1}' % s)
    _truncate(os.path.join(paths[-1], "state.pt"))
    with pytest.raises(ckpt.CheckpointError, match=r"state\.pt does not load"):
        ckpt.load_checkpoint(paths[-1], restore_rng=False)
    msgs = []
    assert ckpt.latest_checkpoint(out, log=msgs.append) == paths[-2] and "state.pt" in msgs[0]


def test_no_intact_checkpoint_is_an_error_naming_them(tmp_path):
    out = str(tmp_path)
    for p in _three_checkpoints(out):
        _flip(os.path.join(p, "state.pt"))
    with pytest.raises(ckpt.CheckpointError, match="none of the 3 checkpoints verifies"):
        ckpt.latest_checkpoint(out, log=lambda m: None)
    assert ckpt.latest_checkpoint(str(tmp_path / "empty")) is None


def test_resume_falls_back_and_still_continues_exactly(cfg_factory, tmp_path):
    """Flipped bytes in the newest checkpoint's weights: resume skips it with a message naming
    the file, continues from the one before, and ends bit-identical to an uninterrupted run."""
    def make(out):
        cfg = cfg_factory("steps=4", "checkpoint.every=1", "checkpoint.keep_last=5",
                          f"logging.out_dir={tmp_path / out}")
        msgs = []
        return Trainer(cfg, task=NoisyTask(), log=msgs.append), msgs

    a, _ = make("a")
    a.train()
    wa = _weights(a)
    a.close()
    b, _ = make("b")
    for _ in range(3):
        b.step()
    b.close()
    paths = ckpt.list_checkpoints(str(tmp_path / "b"))
    assert paths[-1].endswith("step-00000003")
    _flip(os.path.join(paths[-1], "model", "model.safetensors"))
    c, msgs = make("b")
    assert c.maybe_resume() == paths[-2] and c.step_num == 2
    assert any("step-00000003" in m and "model.safetensors" in m for m in msgs), msgs
    c.train()
    wc = _weights(c)
    c.close()
    for k in wa:
        assert torch.equal(wa[k], wc[k]), f"{k} differs between the uninterrupted and the resumed run"


# -- atomic HF model folders (the SFT model) --

class _Model:
    """save_pretrained writing two files; `fail_after` bytes of the second then raise / die."""

    def __init__(self, value, fail=None):
        self.value, self.fail = value, fail

    def save_pretrained(self, path, **kw):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write('{"v": %d}' % self.value)
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(bytes([self.value]) * 50_000)
            if self.fail == "raise":
                raise OSError(28, "No space left on device")
            if self.fail == "kill":
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)


def test_save_model_atomic_keeps_the_previous_folder_on_failure(tmp_path):
    path = str(tmp_path / "sft" / "model")
    with pytest.raises(OSError):
        ckpt.save_model_atomic(_Model(1, fail="raise"), None, path)
    assert not os.path.exists(path) and os.listdir(tmp_path / "sft") == []  # none, and no temp left
    ckpt.save_model_atomic(_Model(1), None, path)
    assert ckpt.is_complete_model_dir(path, verify=True)
    with pytest.raises(OSError):
        ckpt.save_model_atomic(_Model(2, fail="raise"), None, path)
    assert ckpt.is_complete_model_dir(path, verify=True)
    assert open(os.path.join(path, "config.json")).read() == '{"v": 1}'
    ckpt.save_model_atomic(_Model(3), None, path)  # a re-save replaces it
    assert open(os.path.join(path, "config.json")).read() == '{"v": 3}' and os.listdir(tmp_path / "sft") == ["model"]


def test_half_written_model_folder_is_not_complete(tmp_path):
    path = str(tmp_path / "m")
    _Model(1).save_pretrained(path)  # what a plain save_pretrained killed midway can leave
    assert not ckpt.is_complete_model_dir(path)
    ckpt.save_model_atomic(_Model(1), None, path)
    _truncate(os.path.join(path, "model.safetensors"))
    assert not ckpt.is_complete_model_dir(path)
    ckpt.save_model_atomic(_Model(1), None, path)
    _flip(os.path.join(path, "model.safetensors"))
    assert ckpt.is_complete_model_dir(path) and not ckpt.is_complete_model_dir(path, verify=True)


_KILLED_SAVE = r"""
import sys
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/../trainer"]  # test_checkpoint imports trainer_helpers
from test_checkpoint import _Model
from fastgrpo.runs import checkpoint as ckpt
ckpt.save_model_atomic(_Model(int(sys.argv[3]), fail="kill"), None, sys.argv[1])
"""


def test_kill9_during_model_save_leaves_previous_or_none(tmp_path):
    path = str(tmp_path / "sft" / "model")
    here = os.path.dirname(os.path.abspath(__file__))
    run = [sys.executable, "-c", _KILLED_SAVE, path, here]
    assert subprocess.run(run + ["1"]).returncode == -signal.SIGKILL
    assert not os.path.exists(path)  # none: the first save never finished
    ckpt.save_model_atomic(_Model(5), None, path)  # removes the dead writer's temp folder
    assert os.listdir(tmp_path / "sft") == ["model"]
    assert subprocess.run(run + ["6"]).returncode == -signal.SIGKILL
    assert ckpt.is_complete_model_dir(path, verify=True)
    assert open(os.path.join(path, "config.json")).read() == '{"v": 5}'


def test_atomic_write_text(tmp_path):
    p = str(tmp_path / "config.yaml")
    ckpt.atomic_write_text(p, "a: 1\n")
    ckpt.atomic_write_text(p, "a: 2\n")
    assert open(p).read() == "a: 2\n" and os.listdir(tmp_path) == ["config.yaml"]


def test_a_run_folder_of_the_previous_layout_resumes_exactly(tmp_path):
    """Run folders written before the house split (issue 32: trainer/ → runs/, logs/, recipes/)
    still resume. The checkpoint format is untouched by the split (same files, same state.pt
    keys); tests/runs/data/old_layout_run was written by commit be44770 (the layout before the
    split): 2 steps of the tiny config, a checkpoint each step. Resumed here to step 4, the
    run samples the completions that commit sampled when it resumed the same folder
    (old_layout_run_steps_3_4.jsonl): weights, optimizer, RNG and sampler state all came back."""
    import json
    import shutil

    from trainer_helpers import tiny_cfg

    from fastgrpo.pipeline import run_train

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
    run = tmp_path / "run"
    shutil.copytree(os.path.join(here, "old_layout_run"), run)
    args = ("checkpoint.every=1", "checkpoint.at_end=true", "checkpoint.keep_last=1", "data.num_heldout=0",
            "logging.samples_every=1", "rollout.temperature=1.0")
    logs = []
    summary = run_train(tiny_cfg(run, "steps=4", *args), log=logs.append)
    assert any("resumed from" in m and "step-00000002" in m for m in logs), logs
    assert summary["steps"] == 4
    got = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    got = [{k: r[k] for k in ("step", "prompt_id", "index", "prompt", "completion")} for r in got if r["step"] > 2]
    with open(os.path.join(here, "old_layout_run_steps_3_4.jsonl")) as f:
        want = [json.loads(line) for line in f]
    assert len(want) == 8 and got == want  # 4 rows a step (logging.samples_max picks them)
