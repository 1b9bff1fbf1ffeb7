"""Trainer behaviour on bad input: non-finite loss skips the update (weights untouched) and
stops the run after max_nan_skips; a reward function that raises is reported with the prompt id
and scored as configured; the run folder holds metrics.jsonl, TensorBoard events and plots."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from trainer_helpers import NoisyTask, stale_trainer

from fastgrpo.logs.metrics import nvtx_range, set_nvtx
from fastgrpo.pipeline import run_train
from fastgrpo.trainer.grpo import Trainer, TrainingStopped


def _poison_when_training(model, steps_to_poison):
    """Forward hook: NaN hidden states during the update of the given trainer steps (rollouts
    run the model in eval mode and stay finite)."""
    state = {"step": 0}

    def hook(module, args, out):
        if module.training and state["step"] in steps_to_poison:
            return out * float("nan")
        return out

    model.model.norm.register_forward_hook(hook)
    return state


def test_nan_loss_skips_update_then_stops(cfg_factory):
    msgs = []
    t = Trainer(cfg_factory("steps=5", "max_nan_skips=2"), task=NoisyTask(), log=msgs.append)
    state = _poison_when_training(t.backend.module, {1, 3})
    before = {k: v.clone() for k, v in t.backend.module.state_dict().items()}
    state["step"] = 1
    logs = t.step()
    assert logs["train/skipped"] == 1.0 and t.nan_skips == 1
    for k, v in t.backend.module.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed although the update was skipped"
    assert all(torch.isfinite(p).all() for p in t.backend.module.parameters())
    state["step"] = 2
    logs = t.step()
    assert "train/skipped" not in logs and any(not torch.equal(v, before[k]) for k, v in t.backend.module.state_dict().items())
    state["step"] = 3
    with pytest.raises(TrainingStopped, match="max_nan_skips=2"):
        t.step()
    assert any("non-finite" in m and "skipped" in m for m in msgs)
    t.close()


def test_reward_exception_reported_with_prompt_id(cfg_factory):
    msgs = []
    t = Trainer(cfg_factory("steps=2", "rewards.error_score=-1.0"), task=NoisyTask(fail_even=True), log=msgs.append)
    t.train()
    errs = [m for m in msgs if "reward error" in m]
    assert errs and t.reward_errors == len(errs)
    by_id = {p.id: p for p in t.task.train}
    for m in errs:
        pid = int(m.split("prompt id ")[1].split(":")[0])
        assert int(by_id[pid].answer) % 2 == 0, m  # only the prompts the verifier fails on
        assert "verifier crashed" in m
    rows = [json.loads(x) for x in open(os.path.join(t.cfg.logging.out_dir, "metrics.jsonl"))]
    assert rows[-1]["train/reward_errors"] == t.reward_errors
    assert rows[-1]["reward/format/mean"] < 0.5  # failing groups scored error_score = -1
    t.close()


def test_reward_drop_mode_drops_failing_groups(cfg_factory):
    t = Trainer(cfg_factory("steps=1", "rewards.on_error=drop"), task=NoisyTask(fail_even=True), log=lambda m: None)
    problems = t.curriculum.sample(4)
    groups = t._rollout(problems)
    per_fn, total, dropped = t._score(problems, groups)
    assert dropped == {i for i, p in enumerate(problems) if int(p.answer) % 2 == 0}
    _, _, keep, _ = t._advantages(problems, per_fn, total, dropped)
    assert not any(keep[i] for i in dropped)
    t.close()


def test_pipeline_writes_metrics_events_plots_checkpoint(cfg_factory, tmp_path):
    out = tmp_path / "run"
    cfg = cfg_factory("sft_first=true", "logging.tensorboard=true", "logging.plots=true", "checkpoint.at_end=true",
                      f"logging.out_dir={out}")
    summary = run_train(cfg, log=lambda m: None)
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    assert [s for s, _ in evals] == [0, 2]  # SFT checkpoint and end of GRPO
    assert summary["accuracy_before"] == evals[0][1] and summary["accuracy_after"] == evals[1][1]
    steps = [r for r in rows if "timing/rollout" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for key in ("reward/mean", "reward/accuracy/mean", "train/zero_std_frac", "completion/length_mean",
                "completion/truncation_rate", "perf/throughput", "timing/reward", "timing/update", "timing/sync",
                "timing/old_logp", "train/pass_rate_hist"):
        assert key in steps[-1], key
    assert steps[-1]["perf/throughput"] > 0
    assert glob.glob(str(out / "tb" / "events.out.tfevents.*"))
    pngs = sorted(os.path.basename(p) for p in glob.glob(str(out / "plots" / "*.png")))
    assert pngs == ["accuracy.png", "kl.png", "length.png", "reward.png"]
    assert os.path.isdir(out / "checkpoints" / "step-00000002" / "model")
    assert os.path.isdir(out / "sft" / "model")


def test_nvtx_range_runs_when_enabled():
    set_nvtx(True)
    try:
        with nvtx_range("rollout"):
            x = 1
    finally:
        set_nvtx(None)
    assert x == 1


def test_cli_smoke_two_steps(tmp_path):
    from trainer_helpers import TINY

    out = tmp_path / "cli"
    args = [sys.executable, "-m", "fastgrpo.cli", "train", "--out", str(out), "--nvtx"]
    for item in TINY + ["sft_first=true", "logging.plots=true"]:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out accuracy" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "accuracy_after" in summary
    bad = subprocess.run([sys.executable, "-m", "fastgrpo.cli", "train", "--set", "optimizer.lrr=1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "optimizer.lrr" in bad.stderr


def test_reference_model_only_when_beta_positive(cfg_factory):
    t0 = Trainer(cfg_factory("steps=1"), task=NoisyTask(), log=lambda m: None)
    assert t0.ref_model is None
    t0.close()
    t = Trainer(cfg_factory("steps=2", "algorithm.beta=0.1", "algorithm.inner_steps=2"), task=NoisyTask(),
                log=lambda m: None)
    assert t.ref_model is not None and not any(p.requires_grad for p in t.ref_model.parameters())
    ref0 = {k: v.clone() for k, v in t.ref_model.state_dict().items()}
    t.step()
    logs = t.step()
    assert "loss/kl_mean" in logs and logs["loss/kl_mean"] >= 0  # k3 KL is non-negative
    assert logs["loss/kl_mean"] > 0  # the policy moved away from the frozen reference
    assert all(torch.equal(v, ref0[k]) for k, v in t.ref_model.state_dict().items())
    t.close()


def test_shared_prefix_packing_trains_like_unshared(cfg_factory):
    """packing.share_prefix (default on) changes the layout of the update's micro-batches, not
    the update: two steps with K = 2, β > 0 (old and reference log-probs scored on the same
    layout) end with the same weights and losses as with share_prefix=false."""
    runs = {}
    for share in ("true", "false"):
        t = Trainer(cfg_factory("steps=2", "algorithm.beta=0.1", "algorithm.inner_steps=2",
                                f"packing.share_prefix={share}"), task=NoisyTask(), log=lambda m: None)
        init = {k: v.clone() for k, v in t.backend.module.state_dict().items()}
        packed = []
        pack = t._pack

        def capture(*args):
            out = pack(*args)
            packed.extend(out)
            return out

        t._pack = capture
        logs = [t.step(), t.step()]
        shared = [b for b in packed if b is not None and b.segment_prefix is not None and b.segment_prefix[:, 1].any()]
        assert bool(shared) == (share == "true")
        runs[share] = (logs, {k: v.clone() for k, v in t.backend.module.state_dict().items()})
        assert any(not torch.equal(v, init[k]) for k, v in runs[share][1].items()), "no update was applied"
        assert t._share_prefix() == (share == "true")
        t.close()
    (la, wa), (lb, wb) = runs["true"], runs["false"]
    for a, b in zip(la, lb):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
        assert a["loss/kl_mean"] == pytest.approx(b["loss/kl_mean"], abs=1e-6)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5), k


def test_engine_behind_the_policy_supplies_the_old_logprobs(cfg_factory):
    """sync.every = 2 with an engine holding its own weights: step 1 samples from the current
    policy (ratio 1, no old log-probs); step 2 samples from weights one update old, so the packed
    batch carries the rollout's own sampling log-probs as old log-probs and the importance ratio
    moves off 1; step 3 (after the step-2 sync) is on-policy again."""
    t, seen = stale_trainer(cfg_factory)
    logs = [t.step() for _ in range(3)]
    for step, (batches, problems, groups) in enumerate(seen, start=1):
        real = [b for b in batches if b is not None]
        assert real
        if step != 2:
            assert all(b.old_logp is None for b in real), step
            continue
        completion = {(p.id, j): c for p, g in zip(problems, groups) for j, c in enumerate(g)}
        for b in real:
            assert b.old_logp is not None
            lo = b.loss_cu_seqlens.tolist()
            for s, key in enumerate(b.ids):
                assert b.old_logp[lo[s]:lo[s + 1]].tolist() == pytest.approx(completion[key].logprobs, abs=1e-6)
    assert logs[0]["loss/ratio_max"] == pytest.approx(1.0) and logs[2]["loss/ratio_max"] == pytest.approx(1.0)
    assert abs(logs[1]["loss/ratio_max"] - 1.0) > 1e-4 or abs(logs[1]["loss/ratio_min"] - 1.0) > 1e-4
    t.close()


def test_top_k_with_an_engine_behind_the_policy_is_refused(cfg_factory):
    """Truncated sampling log-probs are not the policy's: with sync.every > 1 and an engine of
    its own they cannot be the old log-probs, so the trainer refuses the combination, naming
    the fields; the built-in engine on the trainer's module is never behind and is accepted."""
    from fastgrpo.trainer.build import build_model
    from fastgrpo.rollout.torch_engine import TorchEngine

    cfg = cfg_factory("sync.every=2", "rollout.top_k=5")
    model, tok = build_model(cfg.model)
    with pytest.raises(ValueError, match=r"sync.every=2 with rollout.top_k=5"):
        Trainer(cfg, model, tok, task=NoisyTask(), engine=TorchEngine(model, tok, copy_model=True), log=lambda m: None)
    Trainer(cfg, model, tok, task=NoisyTask(), engine=TorchEngine(model, tok), log=lambda m: None).close()


def test_a_trainer_built_without_a_task_formats_prompts_as_the_cli_does(cfg_factory, tmp_path, monkeypatch):
    """`Trainer(cfg, model, tokenizer)` builds its task from cfg.data through the tokenizer's chat
    template, as `fastgrpo train` (pipeline.load_run) does: the prompts a library user trains on
    are the ones the CLI would (they were the raw questions, which the model answers worse)."""
    import json

    from fastgrpo.pipeline import load_run
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.grpo import Trainer

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) for i in range(12)) + "\n")
    cfg = cfg_factory(f"data.path={data}", "data.task=auto", "data.num_heldout=2")
    model, tok = build_model(cfg.model)
    tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}={% endif %}"
    t = Trainer(cfg, model, tok, log=lambda m: None)
    try:
        prompts = sorted(p.prompt for p in t.task.train)
    finally:
        t.close()
    assert prompts and all(p.startswith("<") and p.endswith(">=") for p in prompts), prompts[:3]
    cfg.model.path = "tiny"
    monkeypatch.setattr("fastgrpo.trainer.build.build_tokenizer", lambda mcfg: (tok, None))
    _, task, _ = load_run(cfg, log=lambda m: None)
    assert prompts == sorted(p.prompt for p in task.train)
