"""Builders and small pieces: LR schedules, the jsonl task, metrics files with a torn line,
the arithmetic task's rewards and split."""
import json
import math

import pytest
import torch

from fastgrpo.trainer.build import build_model, build_optimizer, build_task
from fastgrpo.config import load_config
from fastgrpo.tasks.arithmetic import ArithmeticTask, accuracy_reward, format_reward
from fastgrpo.logs.metrics import MetricsLogger, make_plots, read_metrics


def _lrs(schedule, steps=10, warmup=2, floor=0.1):
    cfg = load_config(None, [f"optimizer.schedule={schedule}", f"optimizer.warmup_steps={warmup}",
                             f"optimizer.min_lr_ratio={floor}", "optimizer.lr=1.0"]).optimizer
    opt, sched = build_optimizer(torch.nn.Linear(2, 2), cfg, steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_schedules():
    cos = _lrs("cosine")
    assert cos[0] == pytest.approx(0.5) and cos[1] == pytest.approx(1.0)  # linear warmup over 2 steps
    assert cos[2] == pytest.approx(1.0) and all(a >= b for a, b in zip(cos[2:], cos[3:]))
    assert cos[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    lin = _lrs("linear", warmup=0)
    assert lin[0] == 1.0 and lin[5] == pytest.approx(0.1 + 0.9 * 0.5)
    assert _lrs("constant", warmup=0) == [1.0] * 10


def test_arithmetic_task_split_and_rewards():
    t = ArithmeticTask(20, 50, seed=3)
    assert len(t.train) == 350 and len(t.heldout) == 50
    assert not {p.prompt for p in t.train} & {p.prompt for p in t.heldout}
    assert accuracy_reward(["<think>x</think><answer>19</answer>", "<answer>18</answer>", "19"], ["19"] * 3) == [1.0, 0.0, 0.0]
    assert format_reward(["<think>7+12</think><answer>19</answer>", "<answer>19</answer>", "<think>a</think><answer>1</answer>x"]) == [1.0, 0.0, 0.0]
    import random

    clean = t.sft_completion(t.train[0], random.Random(0))
    a, b = t.operands(t.train[0])
    assert clean == f"<think>{b}+{a}</think><answer>{a + b}</answer>"
    with pytest.raises(ValueError, match="num_heldout"):
        ArithmeticTask(5, 25)


def test_jsonl_task(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n\n" + json.dumps({"prompt": "2+2=", "answer": 4}) + "\n")
    cfg = load_config(None, ["data.task=jsonl", f"data.path={p}"])
    task = build_task(cfg.data)
    assert [(q.id, q.answer) for q in task.train] == [(0, "2"), (2, "4")] and task.heldout == []
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        build_task(load_config(None, ["data.task=jsonl", f"data.path={bad}"]).data)
    with pytest.raises(ValueError, match="data.path"):
        load_config(None, ["data.task=jsonl"])


def test_metrics_logger_and_torn_line(tmp_path):
    log = MetricsLogger(str(tmp_path), tensorboard=False)
    log.log(1, {"reward/mean": torch.tensor(0.5), "loss/kl_mean": float("nan"), "train/pass_rate_hist": [1, 2]})
    log.log(2, {"reward/mean": 0.75, "eval/accuracy": 0.4})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # killed mid-write
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.5 and rows[0]["loss/kl_mean"] is None
    pngs = make_plots(str(tmp_path))
    assert len(pngs) == 4 and all(open(p, "rb").read(4) == b"\x89PNG" for p in pngs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_optimizer_is_fused_adamw_and_steps(dtype):
    """torch's fused AdamW (what build_optimizer picks on CPU) takes the step the per-tensor
    AdamW takes, in float32 and bfloat16."""
    cfg = load_config(None, [f"model.dtype={dtype}", "model.hidden_size=32", "model.num_hidden_layers=1",
                             "model.intermediate_size=64", "model.num_attention_heads=2"])
    model, _ = build_model(cfg.model)
    opt, sched = build_optimizer(model, cfg.optimizer, 10)
    assert opt.defaults["fused"] is True
    ref = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in model.parameters()], lr=cfg.optimizer.lr,
                            betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay)
    model(input_ids=torch.tensor([[3, 4, 5, 6]])).logits.float().pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.param_groups[0]["params"]):
        q.grad = p.grad.clone()
    opt.step()
    ref.step()
    tol = 1e-6 if dtype == "float32" else 1e-2
    for p, q in zip(model.parameters(), ref.param_groups[0]["params"]):
        assert torch.allclose(p.float(), q.float(), atol=tol), "fused AdamW departs from the per-tensor one"
