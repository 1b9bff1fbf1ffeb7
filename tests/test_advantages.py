"""Group-relative advantages (fastgrpo/advantages.py): the seed's worked examples, each
estimator's definition, σ = 0 groups, bad input, and the per-token broadcast."""
import math

import pytest
import torch

from fastgrpo import broadcast_to_tokens, compute_advantages
from fastgrpo.advantages import zero_std_groups


def test_seed_worked_examples_population_sigma():
    a = compute_advantages(torch.tensor([1, 1, 0, 1, 0, 0, 1, 1.0]), group_size=8)
    # mean 5/8, population σ = √(5/8·3/8) = 0.4841: correct (1−0.625)/σ = +0.775, incorrect −1.291
    assert a[0].item() == pytest.approx(0.775, abs=1e-3) and a[2].item() == pytest.approx(-1.291, abs=1e-3)
    assert torch.equal(a > 0, torch.tensor([1, 1, 0, 1, 0, 0, 1, 1]).bool())
    b = compute_advantages(torch.tensor([1, 0, 0, 1, 0, 0, 1, 0.0]), group_size=8)
    assert b[0].item() == pytest.approx(1.291, abs=1e-3) and b[1].item() == pytest.approx(-0.775, abs=1e-3)
    for est in ("grpo", "dr_grpo", "rloo", "kimi"):
        z = compute_advantages(torch.tensor([0.3, 0.3, 0.3, 0.3, 1.0, 1.0, 1.0, 1.0]), 4, estimator=est)
        assert torch.count_nonzero(z) == 0, est  # all-equal groups give exactly 0


def test_estimators_definitions():
    r = torch.tensor([[1.0, 0.0, 0.5, 0.0], [2.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    mean = r.mean(1, keepdim=True)
    torch.testing.assert_close(compute_advantages(r, 4, "dr_grpo"), r - mean)
    torch.testing.assert_close(compute_advantages(r, 4, "kimi"), r - mean)
    torch.testing.assert_close(compute_advantages(r, 4, "kimi", baseline="batch"), r - r.mean())
    loo = (r.sum(1, keepdim=True) - r) / 3
    torch.testing.assert_close(compute_advantages(r, 4, "rloo"), r - loo)
    sample = r.std(1, keepdim=True, correction=1)
    torch.testing.assert_close(compute_advantages(r, 4, std="sample", eps=0.0), (r - mean) / sample)
    torch.testing.assert_close(compute_advantages(r, 4, scale="batch", eps=0.0), (r - mean) / r.std(correction=0))
    torch.testing.assert_close(compute_advantages(r, 4, scale="none"), r - mean)
    # a flat [B] input gives a flat [B] output, a list gives the default float dtype
    assert compute_advantages(r.reshape(-1), 4).shape == (8,)
    assert compute_advantages([1, 0, 1, 1], 2).dtype == torch.get_default_dtype()


def test_sigma_zero_never_nan_and_zero_std_groups():
    r = torch.tensor([0.1, 0.1, 0.1, 5.0, 4.0, 5.0])
    for eps in (0.0, 1e-4):
        a = compute_advantages(r, 3, eps=eps)
        assert bool(torch.isfinite(a).all()) and torch.count_nonzero(a[:3]) == 0
    assert zero_std_groups(r, 3).tolist() == [True, False]
    assert torch.count_nonzero(compute_advantages(torch.tensor([1.0, 2.0]), 1, std="sample")) == 0
    assert compute_advantages(torch.zeros(0), 4).shape == (0,)


@pytest.mark.parametrize("kwargs,match", [
    (dict(rewards=[1.0, 0.0, 1.0], group_size=2), "multiple of group_size"),
    (dict(rewards=[1.0, 0.0], group_size=0), "group_size"),
    (dict(rewards=[1.0, float("nan")], group_size=2), "non-finite"),
    (dict(rewards=[1.0, 0.0], group_size=2, estimator="ppo"), "estimator"),
    (dict(rewards=[1.0, 0.0], group_size=2, scale="token"), "scale"),
    (dict(rewards=[1.0, 0.0], group_size=2, std="biased"), "std"),
    (dict(rewards=[1.0, 0.0], group_size=2, eps=-1.0), "eps"),
    (dict(rewards=[1.0, 0.0], group_size=1, estimator="rloo"), "rloo"),
    (dict(rewards=torch.zeros(2, 3), group_size=2), r"\[num_groups, group_size=2\]"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(**kwargs)


def test_broadcast_to_tokens():
    vals = torch.tensor([0.5, -1.0, 2.0])
    out = broadcast_to_tokens(vals, cu_seqlens=torch.tensor([0, 2, 2, 5]))
    assert out.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    assert torch.equal(broadcast_to_tokens(vals, lengths=[2, 0, 3]), out)
    with pytest.raises(ValueError, match="exactly one"):
        broadcast_to_tokens(vals)
    with pytest.raises(ValueError, match="cu_seqlens.*2 sequences"):
        broadcast_to_tokens(vals, cu_seqlens=torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="lengths"):
        broadcast_to_tokens(vals, lengths=[1, -1, 2])
    assert math.isclose(float(broadcast_to_tokens(vals, lengths=torch.tensor([1, 1, 1])).sum()), 1.5)
