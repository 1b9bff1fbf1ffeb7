"""RM-GRPO end to end: GRPO on the tiny policy with a reward model trained in the test as the
only reward raises the frequency of the marker it prefers; the two-stage pipeline (RLVR, then
RM-GRPO on a mixed prompt set, fastgrpo/recipes/stages.py) runs, logs the stage in its own
folder and resumes inside the stage without running RLVR again; bad stage inputs fail at load."""
import json
import os

import pytest

from fastgrpo.rollout.base import SamplingConfig
from fastgrpo.runs.checkpoint import list_checkpoints
from fastgrpo.logs.metrics import read_metrics
from reward_models import MARKER, marker_rm
from trainer_helpers import tiny_cfg


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return marker_rm(tmp_path_factory)


def _marker_rate(trainer, n_prompts=16, G=8):
    probs = trainer.task.train[:n_prompts]
    ids = trainer.tokenizer([p.prompt for p in probs], add_special_tokens=False)["input_ids"]
    groups = trainer.engine.generate(ids, n=G, sampling=SamplingConfig(temperature=1.0, max_new_tokens=8, seed=7))
    texts = [c.text for g in groups for c in g]
    return sum(MARKER in t for t in texts) / len(texts)


def test_grpo_with_the_trained_reward_model_raises_the_marker_frequency(rm_path, tmp_path):
    from fastgrpo.trainer.grpo import Trainer

    cfg = tiny_cfg(tmp_path, "rewards.functions=[marker]", "rewards.weights=[1.0]",
                   f"rewards.models={{marker: {{path: {rm_path}, device: cpu, normalize: group}}}}",
                   "steps=20", "optimizer.lr=3e-3", "rollout.prompts_per_step=8", "rollout.group_size=8",
                   "algorithm.max_pass_rate=1.0")
    trainer = Trainer(cfg)
    try:
        before = _marker_rate(trainer)
        rows = []
        trainer.train(on_step=lambda s, m: rows.append(m))
        trainer.sync_engine()
        after = _marker_rate(trainer)
    finally:
        trainer.close()
    print("marker rate", before, after)
    assert after > before + 0.2, (before, after)
    assert all(r["reward/marker/mean"] == pytest.approx(0.0, abs=1e-6) for r in rows)  # z-scored within groups
    assert rows[-1]["reward/marker/scored"] == 64.0  # one batched call over the 8 × 8 completions


def _stage_args(tmp_path, rm_path, steps=2):
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (5, 1))]
    rows += [{"prompt": p} for p in ("hi:", "say:", "ok:")]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["checkpoint.at_end=true", f"rewards.models={{marker: {{path: {rm_path}, device: cpu, normalize: group}}}}",
            f"rm_stage.steps={steps}", f"rm_stage.prompts={path}", "rm_stage.functions=[accuracy, marker]",
            "rm_stage.weights=[1.0, 0.5]", "rm_stage.lr=1e-3"]


def test_two_stage_pipeline_runs_then_resumes_inside_the_stage(rm_path, tmp_path):
    from fastgrpo.pipeline import run_train

    out = tmp_path / "run"
    logs = []
    summary = run_train(tiny_cfg(out, *_stage_args(tmp_path, rm_path)), log=logs.append)
    stage = out / "rm_stage"
    assert summary["steps"] == 2 and summary["rm_stage/steps"] == 2
    assert [os.path.basename(c) for c in list_checkpoints(str(stage))] == ["step-00000002"]
    rows = read_metrics(str(stage / "metrics.jsonl"))
    train_rows = [r for r in rows if "reward/marker/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert any("eval/accuracy" in r for r in rows)  # the RLVR task's held-out set, before and after the stage
    rlvr_rows = len(read_metrics(str(out / "metrics.jsonl")))
    assert not any("reward/marker/mean" in r for r in read_metrics(str(out / "metrics.jsonl")))  # a separate phase
    assert any("stage 2 (RM-GRPO): 6 prompts" in line for line in logs)

    logs.clear()  # resumed with a KL anchor: the reference is the RLVR model, not the stage's checkpoint
    summary = run_train(tiny_cfg(out, *_stage_args(tmp_path, rm_path, steps=3), "rm_stage.beta=0.5"), log=logs.append)
    assert summary["rm_stage/steps"] == 3 and summary["steps"] == 2  # RLVR's summary read back
    assert any("stage 2 resumed from" in line and "step-00000002" in line for line in logs)
    assert len(read_metrics(str(out / "metrics.jsonl"))) == rlvr_rows  # RLVR did not run again
    rows = [r for r in read_metrics(str(stage / "metrics.jsonl")) if "reward/marker/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["loss/kl_mean"] > 0  # the stage's 2 updates moved it off the RLVR model
    assert "loss/kl_mean" not in rows[0] or rows[0]["loss/kl_mean"] == 0


def test_mixed_prompt_set_scores_accuracy_only_where_there_is_an_answer(rm_path, tmp_path):
    from fastgrpo.rewards.registry import RewardInputs, build_rewards
    from fastgrpo.tasks.arithmetic import ArithmeticTask
    from fastgrpo.recipes.stages import build_stage_task, stage_config

    cfg = tiny_cfg(tmp_path, *_stage_args(tmp_path, rm_path))
    base = ArithmeticTask(10, 10, 0)
    task = build_stage_task(cfg, None, base)
    assert [p.answer for p in task.train] == ["3", "7", "6", "", "", ""]
    assert min(p.id for p in task.train) > max(p.id for p in base.train + base.heldout)
    assert task.heldout == base.heldout
    rewards = build_rewards(stage_config(cfg).rewards, task, 8)
    probs = [task.train[0], task.train[0], task.train[3], task.train[3]]
    inputs = RewardInputs(completions=["<answer>3</answer>", "<answer>4</answer>!", "x", "x!"], problems=probs,
                          group_size=2)
    assert rewards["accuracy"](inputs) == [1.0, 0.0, None, None]
    routed = rewards["marker"](inputs)  # rm_stage.route: the reward model scores the open-ended rows only
    assert routed[:2] == [None, None] and routed[2:] == pytest.approx([-1.0, 1.0], abs=1e-3)  # z-scores of a 2-group
    every = tiny_cfg(tmp_path, *_stage_args(tmp_path, rm_path), "rm_stage.route=false")
    everywhere = build_rewards(stage_config(every).rewards, build_stage_task(every, None, base), 8)["marker"](inputs)
    assert everywhere == pytest.approx([-1.0, 1.0, -1.0, 1.0], abs=1e-3)


def test_bad_stage_inputs_fail_at_load_naming_them(rm_path, tmp_path, monkeypatch):
    from fastgrpo import pipeline
    from fastgrpo.config import load_config

    built = []
    monkeypatch.setattr(pipeline, "build_model", lambda *a, **k: built.append(1))
    args = _stage_args(tmp_path, rm_path)
    bad_rm = [a if not a.startswith("rewards.models") else
              f"rewards.models={{marker: {{path: {tmp_path}/gone, device: cpu}}}}" for a in args]
    with pytest.raises(ValueError, match=rf"rewards.models.marker: cannot load a classifier .*{tmp_path}/gone"):
        pipeline.run_train(tiny_cfg(tmp_path / "a", *bad_rm))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "hi"}) + "\n")
    bad_rows = [a if not a.startswith("rm_stage.prompts") else f"rm_stage.prompts={tmp_path}/bad.jsonl" for a in args]
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no 'prompt' or 'messages' column"):
        pipeline.run_train(tiny_cfg(tmp_path / "b", *bad_rows))
    unknown = [a if not a.startswith("rm_stage.functions") else "rm_stage.functions=[accuracy, helpful]" for a in args]
    with pytest.raises(ValueError, match=r"rm_stage.functions\[1\]='helpful': unknown reward"):
        pipeline.run_train(tiny_cfg(tmp_path / "c", *unknown))
    assert not built and not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match=r"rm_stage.weights=\[1.0\]: expected one weight per rm_stage.functions"):
        load_config(None, ["rm_stage.steps=2", "rm_stage.prompts=x.jsonl", "rm_stage.functions=[a, b]",
                           "rm_stage.weights=[1.0]"])


def test_cli_train_runs_both_stages_and_reports_an_unloadable_reward_model_in_one_line(rm_path, tmp_path, capsys):
    from fastgrpo.cli import main
    from trainer_helpers import TINY

    def argv(out, extra):
        return ["train", "--out", str(out)] + [x for a in TINY + extra for x in ("--set", a)]

    assert main(argv(tmp_path / "ok", _stage_args(tmp_path, rm_path))) == 0
    assert json.loads((tmp_path / "ok" / "rm_stage" / "summary.json").read_text())["rm_stage/steps"] == 2
    capsys.readouterr()
    bad = [a if not a.startswith("rewards.models") else
           f"rewards.models={{marker: {{path: {tmp_path}/gone, device: cpu}}}}" for a in _stage_args(tmp_path, rm_path)]
    assert main(argv(tmp_path / "bad", bad)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fastgrpo: config rewards.models.marker: cannot load a classifier"), err


def test_a_signal_during_the_stages_final_save_stops_as_it_said(rm_path, tmp_path, monkeypatch):
    """issue 34 (18): SIGTERM while the RM stage writes its end-of-run checkpoint stops the run with
    that checkpoint, as the stopping line said — no held-out evaluation after it, no summary."""
    import signal

    from fastgrpo.pipeline import run_train
    from fastgrpo.runs.folder import TrainingInterrupted
    from fastgrpo.trainer.grpo import Trainer

    real = Trainer.save

    def save(self):
        path = real(self)
        if os.path.basename(self.cfg.logging.out_dir) == "rm_stage":
            self.request_stop(signal.SIGTERM)
        return path

    monkeypatch.setattr(Trainer, "save", save)
    out, logs = tmp_path / "run", []
    with pytest.raises(TrainingInterrupted) as e:
        run_train(tiny_cfg(out, *_stage_args(tmp_path, rm_path)), log=logs.append)
    assert e.value.step == 2 and e.value.checkpoint.endswith(os.path.join("rm_stage", "checkpoints", "step-00000002"))
    assert any("stopping after step 2 " in m for m in logs), logs
    assert not any("stage 2 done" in m for m in logs) and not (out / "rm_stage" / "summary.json").exists()
