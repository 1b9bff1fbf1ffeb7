"""DistributedBackend.step() never applies a non-finite gradient: it skips the update (no
optimizer or scheduler step, gradients dropped), says so, and the next finite step applies
normally. Single process, backend "none" (DDP and ZeRO run the same check; the 2-rank launch in
test_distributed.py poisons a gradient under ZeRO-2, where `p.grad` is None after reduction)."""
import math

import torch

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.trainer.backend import DistributedBackend


def _backend():
    model, _ = build_tiny_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return DistributedBackend(model, opt, sched, backend="none", max_grad_norm=1.0)


def _loss(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


def test_nan_gradient_is_skipped_not_applied():
    backend = _backend()
    before = {k: v.clone() for k, v in backend.module.state_dict().items()}
    lr = backend.optimizer.param_groups[0]["lr"]
    ids = torch.tensor([[5, 6, 7, 8]])
    backend.accumulate([ids], _loss)
    assert backend.local_grads_finite()
    next(backend.module.parameters()).grad[0, 0] = float("nan")  # one element is enough
    assert not backend.local_grads_finite()
    norm = backend.step()
    assert not math.isfinite(norm) and backend.last_step_skipped
    for k, v in backend.module.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed although the gradient was NaN"
    assert backend.optimizer.param_groups[0]["lr"] == lr, "the scheduler stepped on a skipped update"
    assert not backend.optimizer.state, "the optimizer recorded a skipped update"
    assert all(p.grad is None for p in backend.module.parameters()), "the NaN gradient was kept"

    backend.accumulate([ids], _loss)  # a finite step afterwards applies normally
    norm = backend.step()
    assert math.isfinite(norm) and not backend.last_step_skipped
    assert any(not torch.equal(v, before[k]) for k, v in backend.module.state_dict().items())
    assert backend.optimizer.param_groups[0]["lr"] < lr


def test_local_grads_finite_per_dtype():
    """The finiteness check reads one norm per gradient (NaN and ±Inf anywhere propagate); fp16
    gradients are checked element-wise, so a large but finite fp16 gradient is not a false alarm."""
    backend = _backend()
    params = list(backend.module.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    assert backend.local_grads_finite()
    for bad in (float("nan"), float("inf"), float("-inf")):
        params[-1].grad.view(-1)[-1] = bad
        assert not backend.local_grads_finite(), bad
        params[-1].grad.zero_()
    params[0].data = params[0].data.half()
    params[0].grad = torch.full_like(params[0], 60000.0)  # fp16, norm ≫ 65504, finite
    assert backend.local_grads_finite()
    params[0].grad[0, 0] = float("inf")
    assert not backend.local_grads_finite()
    params[1].data = params[1].data.bfloat16()
    params[0].grad.zero_()
    params[1].grad = torch.full_like(params[1], 3e38)  # bf16, finite, its norm overflows
    assert not backend.local_grads_finite(), "an overflowing norm must read as non-finite (the step is skipped)"
    for p in params:
        p.grad = None
    assert backend.local_grads_finite()
