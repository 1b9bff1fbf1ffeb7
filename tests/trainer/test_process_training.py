"""Process rewards in the trainer (fastgrpo/rewards/process.py through fastgrpo/trainer/grpo.py):
the dense step advantages reach the packed batch on the right tokens, groups whose only signal
is the step scores are kept, a failing scorer is reported per completion without stopping the
run, and — on the demo — the dense step signal changes what GRPO learns."""
import copy
import textwrap

import numpy as np
import pytest
import torch

from fastgrpo.packing.layout import unpack
from fastgrpo.trainer.grpo import Trainer
from trainer_helpers import NoisyTask

DEMO_REGEX = "<think>.*?</think>|<answer>.*?</answer>"


def _scorer(tmp_path, body):
    f = tmp_path / "steps_scorer.py"
    f.write_text(textwrap.dedent(body))
    return f"{f}:score"


class FlatTask(NoisyTask):
    """Every outcome reward equal (σ = 0 in every group): only a step signal can teach."""

    def reward_fns(self):
        return {"accuracy": lambda c, a: [0.0] * len(c), "format": lambda c, a: [0.5] * len(c)}


def test_dense_step_advantages_reach_the_packed_tokens(cfg_factory, tmp_path):
    # steps = runs of digits; a step scores 1 when it holds a digit 1..4 (random text has both)
    path = _scorer(tmp_path, """
        def score(prompt, steps, answer):
            return [float(any(d in s for d in "1234")) for s in steps]
    """)
    w = 0.5
    cfg = cfg_factory(f"rewards.process.scorer={path}", r"rewards.process.regex=\d+", f"rewards.process.dense_weight={w}",
                      "rollout.max_new_tokens=16", "rollout.prompts_per_step=8")
    lines = []
    trainer = Trainer(cfg, task=FlatTask(), log=lines.append)
    try:
        r = trainer._round(cfg.rollout.prompts_per_step)
        assert bool((r.adv == 0).all())  # no outcome signal at all
        assert r.keep.any(), "no group had varying step scores; the test needs some"
        assert not any("reward error" in m and "raised" in m for m in lines)
        batches = [b for b in trainer._pack(r.problems, r.groups, r.adv, r.keep) if b is not None]
        comps = {(p.id, j): c for p, g in zip(r.problems, r.groups) for j, c in enumerate(g)}
        seen = 0
        for b in batches:
            for (pid, j), adv in zip(b.ids, unpack(b, b.advantages)):
                c = comps[(pid, j)]
                np.testing.assert_allclose(adv.numpy(), c.step_advantages, rtol=0, atol=1e-7)
                # the ownership rule by hand: a digit run's step runs to the next run; tokens before
                # the first run and after the last digit carry 0; eos (no text) goes with the token before
                pieces = [trainer.tokenizer.decode([t], skip_special_tokens=True) for t in c.token_ids]
                seg, k_step, last_digit = [], -1, max([k for k, x in enumerate(pieces) if x.isdigit()], default=-1)
                for k, x in enumerate(pieces):
                    if x.isdigit() and (k == 0 or not pieces[k - 1].isdigit()):
                        k_step += 1
                    inside = k <= last_digit or (not x and seg and seg[-1] >= 0 and k - 1 == last_digit)
                    seg.append(k_step if inside else -1)
                a = adv.numpy()
                assert not np.any(a[[k for k, g in enumerate(seg) if g < 0]])
                for g in set(seg) - {-1}:
                    assert len({float(v) for v, h in zip(a, seg) if h == g}) == 1
                seen += int(np.any(a != 0))
        assert seen > 0
        logs = trainer.step()  # a whole step with dense advantages and nothing else to learn from
        assert "train/loss" in logs and "train/no_update" not in logs
    finally:
        trainer.close()


def test_a_failing_scorer_is_reported_and_the_run_goes_on(cfg_factory, tmp_path):
    path = _scorer(tmp_path, """
        def score(prompt, steps, answer):
            if int(answer) % 2 == 0:
                raise RuntimeError("step scorer down")
            return [1.0] * (len(steps) + 1)   # wrong number of scores
    """)
    cfg = cfg_factory(f"rewards.process.scorer={path}", "rewards.process.delimiter=+",
                      "rewards.functions=[accuracy, process]", "rewards.weights=[1.0, 1.0]",
                      "rewards.error_score=-0.5", "rewards.process.dense_weight=1.0", "steps=2")
    lines = []
    trainer = Trainer(cfg, task=NoisyTask(), log=lines.append)
    try:
        for _ in range(2):
            logs = trainer.step()
    finally:
        trainer.close()
    errs = [m for m in lines if m.startswith("[fastgrpo] reward error: reward 'process' on prompt id")]
    assert errs and logs["train/reward_errors"] == len(errs) == trainer.reward_errors
    assert all(("step scorer down" in m or "scores for" in m or "no steps" in m) and "error_score" in m for m in errs)
    assert logs["reward/process/mean"] == -0.5  # every completion failed one way or another: error_score


# ------------------------------------------------------------------------------ the demo learns

SEED = 0
STEPS = 16
SCHEDULE = [
    "sft.steps=450", f"steps={STEPS}", "rollout.engine=torch", "rollout.prompts_per_step=32", "data.num_heldout=200",
    "eval.max_problems=200", "eval.every=0", "logging.progress=false", "logging.tensorboard=false",
    "logging.plots=false", "checkpoint.every=0", "checkpoint.at_end=false", "checkpoint.resume=none",
    "rewards.functions=[format]", "rewards.weights=[1.0]",  # a sparse outcome: nearly every group σ = 0
]
DENSE = ["rewards.process.scorer=arithmetic", f"rewards.process.regex={DEMO_REGEX}", "rewards.process.dense_weight=1.0"]


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()  # the demo runs on one thread; later tests get theirs back
    yield
    torch.set_num_threads(n)


@pytest.mark.slow  # ~25 s on 2 idle cores: SFT 450 steps once, then 2 × 16 GRPO steps
def test_the_dense_step_signal_changes_what_the_demo_learns(tmp_path, restore_threads):
    """From one noisy SFT cold start, GRPO with the format reward alone (after SFT nearly every
    completion is well formed: groups of σ = 0, the chapter's stalled sparse outcome) against the
    same run plus the dense process advantage of the `arithmetic` step scorer. Only the second
    can see which answers are right, so only it should move held-out accuracy on carries."""
    from fastgrpo.demo.default import default_config
    from fastgrpo.trainer.build import build_model, build_task
    from fastgrpo.trainer.evaluation import evaluate
    from fastgrpo.trainer.grpo import seed_everything
    from fastgrpo.trainer.sft import run_sft

    base = default_config(SCHEDULE + [f"seed={SEED}"], out_dir=str(tmp_path / "sft"))
    seed_everything(SEED)
    model, tok = build_model(base.model)
    task = build_task(base.data)
    run_sft(base, model, tok, task)
    sft_state = copy.deepcopy(model.state_dict())
    carry = [p for p in task.heldout if sum(x % 10 for x in task.operands(p)) >= 10]
    acc = {"accuracy": task.reward_fns()["accuracy"]}
    result = {}
    for name, extra in (("outcome", []), ("dense", DENSE)):
        cfg = default_config(SCHEDULE + [f"seed={SEED}"] + extra, out_dir=str(tmp_path / name))
        seed_everything(SEED)
        m, _ = build_model(cfg.model)
        m.load_state_dict(sft_state)
        lines = []
        trainer = Trainer(cfg, m, tok, task, log=lines.append)
        try:
            before = evaluate(trainer.engine, carry, acc, cfg.eval, cfg.rollout)["eval/accuracy"]
            rows = []
            trainer.train(on_step=lambda s, logs: rows.append(logs))
            after = evaluate(trainer.engine, carry, acc, cfg.eval, cfg.rollout)["eval/accuracy"]
        finally:
            trainer.close()
        errs = [m for m in lines if "reward error" in m]  # malformed completions have no steps: reported, scored
        assert len(rows) == STEPS and (not errs if name == "outcome" else all("found no steps" in m for m in errs))
        stalled = float(np.mean([r["train/zero_std_frac"] for r in rows]))  # groups without an outcome signal
        result[name] = (before, after, stalled)
    (b0, a0, z0), (b1, a1, _) = result["outcome"], result["dense"]
    print(f"carry accuracy after SFT {b0:.3f}: format only → {a0:.3f} ({100 * z0:.0f}% of groups σ = 0), "
          f"+ dense process → {a1:.3f}")
    assert b0 == b1  # the same SFT weights
    assert z0 >= 0.5, f"only {100 * z0:.0f}% of the format-only groups had σ = 0: not the stalled outcome this tests"
    lift0, lift1 = a0 - b0, a1 - b1
    assert lift1 >= lift0 + 0.05, (f"held-out carry accuracy after SFT {b0:.3f}: format only → {a0:.3f}, "
                                   f"+ dense process → {a1:.3f}; expected the dense run ≥ 5 points ahead")
