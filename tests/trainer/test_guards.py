"""Blow-ups, signals and the run folder's temp files (issue 14): fp16 refused at load; a learning
rate of 1e6 stops the run with its reason and writes no checkpoint of the blown-up model; the
spike guard refuses an update; non-finite sampler logits are a counted, skipped step; SIGTERM
ends a CLI run with a checkpoint, exit 143 and no temp files left, and the run resumes."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from trainer_helpers import TINY, NoisyTask

from fastgrpo.config import load_config
from fastgrpo.trainer.grpo import Trainer, TrainingStopped
from fastgrpo.runs.folder import graceful_signals, run_tmpdir


def test_float16_is_refused_at_load_with_the_reason():
    with pytest.raises(ValueError, match=r"model.dtype='float16'.*loss scale.*bfloat16"):
        load_config(None, ["model.dtype=float16"])


def test_a_huge_learning_rate_stops_the_run_unsaved(cfg_factory, tmp_path):
    cfg = cfg_factory("steps=4", "optimizer.lr=1e6", "checkpoint.every=1", "checkpoint.at_end=true")
    t = Trainer(cfg, task=NoisyTask(), log=lambda m: None)
    with pytest.raises(TrainingStopped, match=r"weight norm .* blew up .*optimizer.lr=1e\+06"):
        t.train()
    t.close()
    assert t.step_num == 1
    assert not os.path.isdir(os.path.join(cfg.logging.out_dir, "checkpoints")) or not os.listdir(
        os.path.join(cfg.logging.out_dir, "checkpoints"))


def test_the_weight_guard_lets_a_normal_update_through(cfg_factory):
    t = Trainer(cfg_factory("steps=2"), task=NoisyTask(), log=lambda m: None)
    t.train()
    assert t.step_num == 2 and t.nan_skips == 0
    t.close()


def test_spike_guard_refuses_an_outlier_and_keeps_the_weights(cfg_factory):
    msgs = []
    t = Trainer(cfg_factory("guard.grad_spike=4", "guard.grad_spike_warmup=3"), task=NoisyTask(), log=msgs.append)
    assert t._grad_guard(1.0) and t._grad_guard(1.2) and t._grad_guard(0.9)
    assert not t._grad_guard(10.0) and any("guard.grad_spike=4" in m for m in msgs)
    assert t._grad_guard(3.0)  # below 4 × the median
    # the backend applies nothing when the guard refuses
    model = t.backend.module
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    t.backend.step(accept=lambda n: False)
    assert t.backend.last_step_skipped
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    t.close()


def test_nonfinite_sampler_logits_are_a_counted_skip(cfg_factory):
    msgs = []
    t = Trainer(cfg_factory("steps=5", "max_nan_skips=2"), task=NoisyTask(), log=msgs.append)
    with torch.no_grad():
        t.backend.module.lm_head.weight.fill_(float("nan"))
    logs = t.step()
    assert logs["train/skipped"] == 1.0 and t.nan_skips == 1
    assert any("non-finite logits while sampling" in m for m in msgs)
    with pytest.raises(TrainingStopped, match="max_nan_skips=2"):
        t.step()
    t.close()


def test_run_tmpdir_holds_temp_files_and_cleans_leftovers(tmp_path):
    out = tmp_path / "run"
    (out / "tmp" / "fastgrpo_vllm_left").mkdir(parents=True)  # what a kill -9 left
    with run_tmpdir(str(out)) as tmp:
        assert not os.path.exists(out / "tmp" / "fastgrpo_vllm_left")
        d = tempfile.mkdtemp(prefix="fastgrpo_vllm_")
        assert d.startswith(tmp) and os.environ["TMPDIR"] == tmp
        import multiprocessing.util

        mp_dir = multiprocessing.util.get_temp_dir()
    assert tempfile.gettempdir() != tmp
    # multiprocessing's folder (a fork server's socket) lives until this process exits: inside the
    # run folder when this run was the first to need one, and then the only thing left there
    left = os.listdir(out / "tmp") if os.path.exists(out / "tmp") else []
    assert left == ([os.path.basename(mp_dir)] if mp_dir.startswith(tmp + os.sep) else []), left


def test_first_signal_requests_a_stop_second_interrupts():
    got = []
    with graceful_signals(got.append):
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [signal.SIGTERM]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):  # outside GRPO: at once
        with graceful_signals(None):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_forked_child_gets_the_default_action_not_the_runs_stop():
    """A process forked while the run's handler is installed (a `fork` pool's worker) that gets the
    run's signal (a process-group kill) dies of it; it never runs the trainer's stop in its copy."""
    got = []
    with graceful_signals(got.append):
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            finally:
                os._exit(7)  # reached only when the signal was handled as the run's stop
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
    assert got == []


def test_sigterm_checkpoints_cleans_and_resumes(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "fastgrpo.cli", "train", "--out", str(out)]
    sets = [x for item in TINY if not item.startswith(("steps=", "checkpoint.")) for x in ("--set", item)]
    sets += ["--set", "steps=10000", "--set", "checkpoint.every=0", "--set", "checkpoint.at_end=true",
             "--set", "data.num_heldout=0"]
    p = subprocess.Popen(args + sets, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if metrics.exists() and any('"reward/mean"' in line for line in metrics.read_text().splitlines()):
            break
        time.sleep(0.2)
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert "interrupted by SIGTERM" in err and "checkpoint" in err and "Traceback" not in err
    ckpts = sorted(os.listdir(out / "checkpoints"))
    assert ckpts, "no checkpoint written on SIGTERM"
    assert not (out / "tmp").exists()
    step = int(ckpts[-1].split("-")[1])
    r = subprocess.run(args + [s if s != "steps=10000" else f"steps={step + 1}" for s in sets],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert f"resumed from" in r.stdout and f"at step {step}" in r.stdout
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    assert max(row["step"] for row in rows if "reward/mean" in row) == step + 1


def _cli_sets(*extra):
    skip = tuple(x.split("=", 1)[0] + "=" for x in extra)
    return [x for item in [t for t in TINY if not t.startswith(skip)] + list(extra) for x in ("--set", item)]


def _wait_for(path, p, seconds=180.0):
    """Poll for the file `path` the subprocess `p` writes when it reaches the moment under test."""
    deadline = time.time() + seconds
    while not os.path.exists(path):
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


HANGING_REWARD = """
import os, time

def hang(completions, *args, **kwargs):
    if os.path.isdir(os.environ["HANG_AFTER"]):  # step 1's checkpoint is written: step 2's rewards never return
        open(os.environ["HANG_MARKER"], "w").close()
        while True:
            time.sleep(3600)
    return [float(any(d in c for d in "1234")) for c in completions]
"""


def test_one_signal_stops_a_hanging_in_process_reward(tmp_path):
    """issue 34: with rewards.timeout=0 a user reward runs in the trainer process; one that never
    returns held the first SIGTERM ("stopping after step 2 …") forever. The first signal now
    stops at once, says so, and keeps the last checkpoint (the step's own cannot be written)."""
    out, marker = tmp_path / "run", tmp_path / "hanging"
    (tmp_path / "hang_reward.py").write_text(HANGING_REWARD)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HANG_AFTER": str(out / "checkpoints" / "step-00000001"),
           "HANG_MARKER": str(marker)}
    p = subprocess.Popen([sys.executable, "-m", "fastgrpo.cli", "train", "--out", str(out),
                          *_cli_sets("steps=3", "checkpoint.every=1", "data.num_heldout=0", "rewards.timeout=0",
                                     f"rewards.functions=[{tmp_path / 'hang_reward.py'}:hang]", "rewards.weights=[1.0]")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(marker, p)
        p.send_signal(signal.SIGTERM)
        so, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("fastgrpo: interrupted by SIGTERM during the rewards of GRPO step 2: "
                                                   "with rewards.timeout=0"), err
    assert f"the last checkpoint is {out / 'checkpoints' / 'step-00000001'}" in err, err
    assert "stopping after step" not in so, "no checkpoint was promised that is not written"
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000001"]


AFTER_THE_LAST_CHECKPOINT = """
import atexit, sys, time
from fastgrpo import cli, pipeline
from fastgrpo.runs import folder
from fastgrpo.trainer.grpo import Trainer

marker, moment = sys.argv[1], sys.argv[2]

def wait_for_the_signal(*args, **kwargs):
    open(marker, "w").close()
    while True:
        time.sleep(3600)

if moment == "final-evaluation":  # its cleanup then blocks and swallows every interrupt
    folder.STOP_GRACE_S = 1.0
    real, calls = pipeline.evaluate, []
    def evaluate(*args, **kwargs):
        calls.append(1)
        return wait_for_the_signal() if len(calls) == 2 else real(*args, **kwargs)
    def close(self):
        while True:
            try:
                time.sleep(3600)
            except BaseException:
                pass
    pipeline.evaluate, Trainer.close = evaluate, close
else:  # "exit": the command has returned, the interpreter is on its way out
    atexit.register(wait_for_the_signal)
sys.argv = ["fastgrpo"] + sys.argv[3:]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("moment, sig", [("final-evaluation", signal.SIGTERM), ("exit", signal.SIGINT)])
def test_a_signal_after_the_final_checkpoint_ends_the_process(tmp_path, moment, sig):
    """issue 34: SIGTERM right after the final checkpoint hung once (no line, alive 60 s later) and a
    later one was ignored (rc 0). After the final checkpoint a signal stops the run at once with
    128 + its number and a line saying the training is done, even when the cleanup then blocks
    (cut after folder.STOP_GRACE_S); after the command returned it ends the process as the
    signal's default action does (status -N here, 128 + N in a shell), never rc 0."""
    out, marker = tmp_path / "run", tmp_path / "reached"
    p = subprocess.Popen([sys.executable, "-c", AFTER_THE_LAST_CHECKPOINT, str(marker), moment, "train", "--out",
                          str(out), *_cli_sets("steps=1", "checkpoint.at_end=true")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_for(marker, p)
        p.send_signal(sig)
        so, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    from fastgrpo.runs.checkpoint import latest_checkpoint

    assert latest_checkpoint(str(out)).endswith("step-00000001")
    if moment == "exit":
        assert p.returncode == -sig and "held-out accuracy:" in so, (p.returncode, err)
        return
    assert p.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] == (
        "fastgrpo: interrupted by SIGTERM after the last GRPO step 1 (checkpoint written), during the final "
        "evaluation; run the same command to finish the run (its cleanup did not end within 1 s: the process ends now)"), err


def test_a_second_run_on_a_locked_folder_is_refused_with_the_holder(cfg_factory):
    from fastgrpo.pipeline import run_train
    from fastgrpo.runs.lock import RunLock, RunLockError

    cfg = cfg_factory("steps=1")
    with RunLock(cfg.logging.out_dir, log=lambda m: None):
        with pytest.raises(RunLockError, match=str(os.getpid())):
            run_train(cfg, log=lambda m: None)
    assert not os.path.exists(os.path.join(cfg.logging.out_dir, "metrics.jsonl"))


def test_a_torn_sft_folder_is_moved_aside_and_sft_runs_again(cfg_factory):
    from fastgrpo.pipeline import run_train

    cfg = cfg_factory("steps=1", "sft_first=true", "sft.steps=1")
    sft = os.path.join(cfg.logging.out_dir, "sft", "model")
    os.makedirs(sft)
    with open(os.path.join(sft, "config.json"), "w") as f:
        f.write('{"model_type": "qwen2", "hidd')  # torn mid-write
    logs = []
    run_train(cfg, log=logs.append)
    assert any("is incomplete" in m and "running SFT again" in m for m in logs)
    assert any("SFT cold start: 1 steps" in m for m in logs)
    parent = os.path.dirname(sft)
    assert [d for d in os.listdir(parent) if d.startswith("model.broken-")], "the torn folder must be kept"
    from fastgrpo.runs.checkpoint import is_complete_model_dir

    assert is_complete_model_dir(sft)


def test_a_huge_prompt_and_a_bad_resume_path_are_refused_at_load(cfg_factory, tmp_path):
    from fastgrpo.pipeline import load_run

    data = tmp_path / "big.jsonl"
    data.write_text(json.dumps({"prompt": "1+" * 500_000 + "1=", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    t0 = time.time()
    with pytest.raises(ValueError, match=r"big.jsonl:1: the prompt is 1000002 tokens, over the cap"):
        load_run(cfg_factory(f"data.path={data}"))
    assert time.time() - t0 < 60
    with pytest.raises(ValueError, match="checkpoint.resume"):
        load_run(cfg_factory(f"checkpoint.resume={tmp_path / 'nope'}"))


def test_a_worker_fault_names_its_step_once():
    """issue 34: `sync.timeout=1e-9` read "stopped at step 0: … at step 0 …"."""
    from fastgrpo.trainer.async_trainer import stopped_line

    timed_out = stopped_line(0, TimeoutError("rollout-worker-0: generate at step 0 timed out after sync.timeout=1e-09 s"))
    assert timed_out.startswith("stopped: rollout-worker-0: generate at step 0 timed out") and timed_out.count("step 0") == 1
    assert stopped_line(7, RuntimeError("the group broke")).startswith("stopped at step 7: the group broke; ")
