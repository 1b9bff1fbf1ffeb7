"""What the model wrote: the bounded selection of a step's rollouts, samples.jsonl written per
step and resumed without duplicates (a torn last line repaired), the TensorBoard text table, an
evaluation's completions in eval_samples.jsonl, an unwritable samples file as one warning line,
and the config checks of logging.samples_*."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
from trainer_helpers import NoisyTask

from fastgrpo.config import load_config
from fastgrpo.trainer.evaluation import evaluate
from fastgrpo.trainer.grpo import Trainer
from fastgrpo.logs.metrics import MetricsLogger, read_metrics
from fastgrpo.logs.samples import SamplesFile, markdown_table, read_samples, select_samples


def _batch(totals, versions=None):
    """Fake step: problems, groups of completions, per-reward scores, totals, advantages, σ = 0 flags."""
    total = np.asarray(totals, dtype=np.float64)
    B, G = total.shape
    problems = [SimpleNamespace(id=100 + i, prompt=f"what is {i}?", key="") for i in range(B)]
    groups = [[SimpleNamespace(text=f"answer {i}.{j}", token_ids=[1] * (j + 2), finish_reason="length" if j == 0 else "stop",
                               **({"policy_version": versions[i][j]} if versions else {}))
               for j in range(G)] for i in range(B)]
    acc = (total > 0.5).astype(np.float64)
    per_fn = {"accuracy": acc, "format": total - acc}
    std = total.std(axis=1, keepdims=True)
    adv = np.where(std > 0, (total - total.mean(axis=1, keepdims=True)) / np.where(std > 0, std, 1), 0.0)
    zero_std = std[:, 0] == 0
    return problems, groups, per_fn, total, adv, zero_std


def test_selection_is_bounded_best_and_worst_plus_no_signal_groups():
    # groups 0, 2, 3 carry a signal; 1 and 4 do not
    b = _batch([[0.1, 1.1, 0.2, 0.0], [0.0] * 4, [1.2, 0.3, 0.0, 1.0], [0.5, 0.4, 0.3, 0.2], [1.0] * 4])
    rows = select_samples(7, *b, max_rows=5)
    assert len(rows) == 5
    picks = [(r["group"], r["pick"], r["index"]) for r in rows]
    # a quarter of 5 → one σ = 0 group; the rest best and worst of groups 0 and 2, then a best alone
    assert picks == [(0, "best", 1), (0, "worst", 3), (1, "no_signal", 0), (2, "best", 0), (2, "worst", 2)]
    r = rows[0]
    assert r["step"] == 7 and r["prompt_id"] == 100 and r["prompt"] == "what is 0?" and r["completion"] == "answer 0.1"
    assert r["rewards"] == {"accuracy": 1.0, "format": pytest.approx(0.1)} and r["reward"] == pytest.approx(1.1)
    assert r["advantage"] > 0 > rows[1]["advantage"] and r["length"] == 3 and r["finish_reason"] == "stop"
    assert r["zero_std"] is False and rows[2]["zero_std"] is True and rows[2]["advantage"] == 0.0
    assert "policy_version" not in r and "key" not in r  # colocated rollouts carry no version
    json.dumps(rows)  # every row is JSON as it is
    for n in (1, 2, 3, 8, 40):
        assert len(select_samples(1, *b, max_rows=n)) == min(n, 3 * 2 + 2)
    flat = _batch([[0.0] * 4] * 6)  # no group with a signal: the whole budget shows σ = 0 groups
    assert [r["pick"] for r in select_samples(1, *flat, max_rows=4)] == ["no_signal"] * 4


def test_policy_version_is_recorded_when_the_rollout_carries_one():
    rows = select_samples(3, *_batch([[0.0, 1.0]], versions=[[4, 5]]), max_rows=2)
    assert [r["policy_version"] for r in rows] == [5, 4]
    c = SimpleNamespace(text="x", token_ids=[1, 2], finish_reason="stop", token_versions=[2, 3])
    b = _batch([[0.0, 1.0]])
    b[1][0][:] = [c, c]
    assert select_samples(3, *b, max_rows=1)[0]["policy_version"] == [2, 3]


def test_samples_file_drops_redone_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    lines = [json.dumps({"step": s, "i": i}) for s in (1, 2, 3, 4) for i in range(2)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 5, "prom')  # killed mid-row at step 5
    f = SamplesFile(str(path))
    f.open(3)  # a run resumed from the checkpoint of step 2 redoes steps 3, 4, 5
    f.write([{"step": 3, "i": 9}])
    f.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses
    assert [(r["step"], r["i"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 9)]
    assert path.read_text().endswith("\n")
    untouched = SamplesFile(str(path))
    untouched.open(10)
    untouched.close()
    assert read_samples(str(path)) == rows


def test_trainer_writes_samples_every_n_steps_and_resumes_without_duplicates(cfg_factory, tmp_path):
    out = tmp_path / "run"
    cfg = cfg_factory("steps=3", f"logging.out_dir={out}", "logging.samples_every=1", "logging.samples_max=3")
    b = Trainer(cfg, task=NoisyTask(), log=lambda m: None)
    b.step()
    b.step()
    b.save()
    b.step()
    b.close()
    path = out / "samples.jsonl"
    with open(path, "a") as f:  # the killed run also wrote a row of a step after its checkpoint, then a torn one
        f.write(json.dumps({"step": 3, "marker": "killed run"}) + "\n" + '{"step": 4, "completion": "abc')
    c = Trainer(cfg, task=NoisyTask(), log=lambda m: None)
    assert c.maybe_resume() and c.step_num == 2
    c.train()
    c.close()
    lines = path.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [1] * 3 + [2] * 3 + [3] * 3  # 3 rows a step, step 3 once
    assert not any("marker" in r for r in rows)
    # metrics.jsonl drops the redone step too (issue 34): one point per step for a plot
    assert [r["step"] for r in read_samples(str(out / "metrics.jsonl"))] == [1, 2, 3]
    for r in rows:
        assert set(r) >= {"prompt_id", "prompt", "completion", "rewards", "reward", "advantage", "length",
                          "finish_reason", "zero_std", "pick"}
        assert set(r["rewards"]) == {"accuracy", "format"}

    # every 2 steps, and the first and the last: a run shorter than samples_every shows samples too
    every2 = cfg_factory("steps=5", f"logging.out_dir={tmp_path / 'two'}", "logging.samples_every=2")
    t = Trainer(every2, task=NoisyTask(), log=lambda m: None)
    t.train()
    t.close()
    assert sorted({r["step"] for r in read_samples(str(tmp_path / "two" / "samples.jsonl"))}) == [1, 2, 4, 5]
    off = cfg_factory("steps=1", f"logging.out_dir={tmp_path / 'off'}", "logging.samples_every=0")
    t = Trainer(off, task=NoisyTask(), log=lambda m: None)
    t.train()
    t.close()
    assert not (tmp_path / "off" / "samples.jsonl").exists()


def test_unwritable_samples_file_is_one_warning_and_the_run_goes_on(tmp_path):
    (tmp_path / "samples.jsonl").mkdir()  # a folder where the file should be: open() fails (also as root)
    msgs = []
    m = MetricsLogger(str(tmp_path), tensorboard=False, samples_every=1, log=msgs.append)
    for step in (1, 2, 3):
        m.log_rollouts(step, *_batch([[0.0, 1.0], [1.0, 1.0]]))
        m.log(step, {"reward/mean": 0.5})
    m.close()
    assert len(msgs) == 1 and "samples.jsonl" in msgs[0] and "goes on" in msgs[0] and "\n" not in msgs[0]
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]


def test_samples_reach_tensorboard_as_a_text_table(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = MetricsLogger(str(tmp_path), tensorboard=True, samples_every=1, samples_max=4)
    m.log_rollouts(1, *_batch([[0.0, 1.0], [0.5, 0.5]]))
    m.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    tag = next(t for t in acc.Tags()["tensors"] if t.startswith("samples"))
    text = acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    assert "| step |" in text and "answer 0.1" in text and "no_signal" in text
    md = markdown_table([{"step": 1, "completion": "a|b\nc", "rewards": {"x": 1.0}}])
    assert "a\\|b↵ c" in md and "reward/x" in md.splitlines()[0]


def test_evaluation_completions_go_beside_their_accuracy(cfg_factory, tmp_path):
    cfg = cfg_factory("logging.samples_every=5")
    t = Trainer(cfg, log=lambda m: None)  # the built-in arithmetic task: 10 held-out problems
    ev = evaluate(t.engine, t.task.heldout, t.reward_fns, cfg.eval, cfg.rollout)
    assert isinstance(ev, dict) and len(ev.samples) == cfg.eval.max_problems * cfg.eval.num_samples
    t.metrics.log(0, ev)
    t.metrics.log(4, ev)
    t.close()
    rows = read_samples(str(tmp_path / "eval_samples.jsonl"))
    assert [r["step"] for r in rows] == [0] * 5 + [4] * 5 and {r["tag"] for r in rows} == {"eval"}
    held = {p.id: p for p in t.task.heldout}
    for r in rows:
        assert r["prompt"] == held[r["prompt_id"]].prompt and isinstance(r["completion"], str)
    assert np.mean([r["score"] for r in rows[:5]]) == pytest.approx(ev["eval/accuracy"])
    assert "eval/accuracy" in read_metrics(str(tmp_path / "metrics.jsonl"))[0]  # the metrics row is unchanged


@pytest.mark.parametrize("item, field", [
    ("logging.samples_every=-1", "logging.samples_every"), ("logging.samples_max=0", "logging.samples_max"),
    ("logging.wandb.mode=sometimes", "logging.wandb.mode"), ("logging.wandb.projekt=x", "logging.wandb.projekt"),
    ("logging.wandb.project=' '", "logging.wandb.project")])
def test_bad_samples_and_wandb_settings_name_the_field(item, field):
    with pytest.raises(ValueError, match=f"config {field}"):
        load_config(None, [item])


def test_fastgrpo_eval_writes_its_completions_and_keeps_existing_rows(cfg_factory, tmp_path):
    """`fastgrpo eval` (pipeline.run_eval) writes every held-out completion to
    <out>/eval_samples.jsonl (step 0, tag eval); an --out holding a training run's rows keeps them
    (appended, never rewritten); samples_every = 0 writes none."""
    from fastgrpo import pipeline

    path = tmp_path / "eval_samples.jsonl"
    path.write_text(json.dumps({"step": 7, "tag": "eval", "prompt_id": 1, "completion": "x"}) + "\n")
    cfg = cfg_factory("logging.samples_every=5")
    lines = []
    out = pipeline.run_eval(cfg, log=lines.append, allow_untrained=True)
    rows = read_samples(str(path))
    assert rows[0]["step"] == 7 and len(rows) == 1 + len(out.samples) == 1 + cfg.eval.max_problems * cfg.eval.num_samples
    assert {r["step"] for r in rows[1:]} == {0} and {r["tag"] for r in rows} == {"eval"}
    assert {r["model"] for r in rows[1:]} == {cfg.model.path} and "model" not in rows[0]
    assert np.mean([r["score"] for r in rows[1:]]) == pytest.approx(out["eval/accuracy"])
    assert any(str(path) in m for m in lines), lines
    off = cfg_factory("logging.samples_every=0", f"logging.out_dir={tmp_path / 'off'}")
    pipeline.run_eval(off, log=lambda m: None, allow_untrained=True)
    assert not (tmp_path / "off" / "eval_samples.jsonl").exists()
