"""Single-process checks of fastgrpo.trainer.backend: prompt shards, micro-batch plans, metric
reduction, the backend's accumulate/step against a plain torch loop, checkpoints, bad input."""
import pytest
import torch

from fastgrpo.trainer.backend import DistributedBackend
from fastgrpo.trainer.collectives import all_gather, all_reduce_metrics, rebalance, shard
from fastgrpo.packing import plan_micro_batches


def test_shard_covers_items_once_with_near_equal_sizes():
    items = list(range(11))
    parts = [shard(items, r, 4) for r in range(4)]
    assert sum(parts, []) == items
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_plan_respects_budget_and_uses_every_sequence_once():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (57,), generator=g).tolist()
    plan = plan_micro_batches(lengths, 64)
    assert sorted(i for b in plan for i in b) == list(range(57))
    assert all(b and sum(lengths[i] for i in b) <= 64 for b in plan)
    assert plan_micro_batches([], 64) == []


def test_plan_keeps_groups_together():
    """With group keys, whole groups share a micro-batch; a group over the budget is cut into
    budget-sized runs; every sequence appears once and no micro-batch exceeds the budget."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 30, (48,), generator=g).tolist()
    keys = [i // 6 for i in range(48)]               # 8 groups of 6 (≤ 174 tokens each)
    plan = plan_micro_batches(lengths, 200, groups=keys)
    assert sorted(i for b in plan for i in b) == list(range(48))
    assert all(sum(lengths[i] for i in b) <= 200 for b in plan)
    where = {i: k for k, b in enumerate(plan) for i in b}
    assert all(len({where[i] for i in range(6 * q, 6 * q + 6)}) == 1 for q in range(8))
    plain = plan_micro_batches(lengths, 200)          # length-only FFD scatters some group
    where = {i: k for k, b in enumerate(plain) for i in b}
    assert any(len({where[i] for i in range(6 * q, 6 * q + 6)}) > 1 for q in range(8))
    big = plan_micro_batches([30] * 6 + [250], 100, allow_oversize=True, groups=[0] * 6 + [1])
    assert sorted(map(sorted, big)) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="groups"):
        plan_micro_batches([1, 2], 10, groups=[0])
    with pytest.raises(ValueError, match="sequence 3 has length 300"):  # the sequence, not its group
        plan_micro_batches([5, 5, 5, 300], 100, groups=[0, 0, 1, 1])


def test_plan_with_groups_when_another_rank_needs_more_micro_batches(monkeypatch):
    """Ranks step together: when another rank needs more micro-batches, this rank balances its
    units (whole groups) over that many by Karmarkar–Karp, or pads with empty ones."""
    import fastgrpo.trainer.collectives as D

    class FakeDist:
        class ReduceOp:
            MAX = "max"

        @staticmethod
        def all_reduce(t, op=None):
            t.fill_(max(int(t.item()), 3))  # another rank needs 3 micro-batches

    monkeypatch.setattr(D, "_world", lambda: 2)
    monkeypatch.setattr(D, "dist", FakeDist)
    lengths = [10, 12, 11, 9] * 3
    keys = [0] * 4 + [1] * 4 + [2] * 4          # 3 groups of 42 tokens: one micro-batch here
    plan = plan_micro_batches(lengths, 100, groups=keys, agree=D.all_reduce_max)
    assert len(plan) == 3 and sorted(i for b in plan for i in b) == list(range(12))
    assert sorted(map(sorted, plan)) == [list(range(4 * q, 4 * q + 4)) for q in range(3)]  # a group each
    plan = plan_micro_batches(lengths[:8], 100, groups=keys[:8], agree=D.all_reduce_max)  # 2 groups for 3: FFD bins + empty ones
    assert len(plan) == 3 and plan.count([]) == 2 and sorted(i for b in plan for i in b) == list(range(8))


def test_plan_oversize_sequence():
    with pytest.raises(ValueError):
        plan_micro_batches([10, 100], 64)
    plan = plan_micro_batches([10, 100], 64, allow_oversize=True)
    assert sorted(map(sorted, plan)) == [[0], [1]]


def test_single_process_reductions_are_identity():
    assert all_reduce_metrics({"a": 1, "b": 2.5}, op="max", ops={"a": "sum"}) == {"a": 1.0, "b": 2.5}
    assert rebalance(["x", "y"], [3, 4]) == ["x", "y"]
    assert all_gather({"ids": [1]}) == [{"ids": [1]}]
    with pytest.raises(ValueError, match="op="):
        all_reduce_metrics({"a": 1.0}, op="median")
    with pytest.raises(ValueError, match="lengths"):
        rebalance(["x"], [1, 2])


def _model():
    from fastgrpo.models.tiny import build_tiny_model

    model, _ = build_tiny_model(seed=0, num_hidden_layers=1)
    return model


def _loss(model, ids):
    return model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean()


def test_backend_accumulate_step_equals_plain_loop():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 50, (2, n), generator=g) for n in (5, 9, 3)]
    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for b in batches:
        _loss(plain, b).backward()
    norm_plain = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5))
    opt.step()

    model = _model()
    backend = DistributedBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="none",
                                 max_grad_norm=0.5)
    outs = backend.accumulate(batches[:2] + [None] + batches[2:], _loss)  # None: a zero-weighted dummy
    assert outs[2] is None and all(isinstance(o, torch.Tensor) for o in outs[:2] + outs[3:])
    norm = backend.step()
    assert norm == pytest.approx(norm_plain, rel=1e-5) and norm > 0.5  # the clip was active
    for (n, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.allclose(p, q, atol=1e-6), n
    assert all(p.grad is None for p in model.parameters())  # step() zeroes the gradients


def test_backend_checkpoint_round_trip(tmp_path):
    model = _model()
    backend = DistributedBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-2), backend="none")
    backend.accumulate([torch.tensor([[5, 6, 7]])], _loss)
    backend.step()
    backend.save_checkpoint(str(tmp_path / "ck"), client_state={"step": 1})
    saved = {k: v.clone() for k, v in backend.full_state_dict().items()}

    other = _model()
    b2 = DistributedBackend(other, torch.optim.AdamW(other.parameters(), lr=1e-2), backend="none")
    assert b2.load_checkpoint(str(tmp_path / "ck")) == {"step": 1}
    assert all(torch.equal(saved[k], v) for k, v in b2.full_state_dict().items())
    assert b2.optimizer.state_dict()["state"].keys() == backend.optimizer.state_dict()["state"].keys()
    with pytest.raises(ValueError, match="state.pt"):
        b2.load_checkpoint(str(tmp_path / "missing"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="fsdp"), "backend="),
    (dict(zero_stage=4), "zero_stage="),
    (dict(max_grad_norm=-1.0), "max_grad_norm="),
])
def test_backend_bad_arguments(kwargs, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        DistributedBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), **{"backend": "none", **kwargs})
    with pytest.raises(ValueError, match="optimizer"):
        DistributedBackend(model, "adam", backend="none")


def test_loss_fn_must_return_a_scalar():
    model = _model()
    backend = DistributedBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="none")
    with pytest.raises(ValueError, match="loss_fn"):
        backend.accumulate([torch.tensor([[5, 6]])], lambda m, b: m(input_ids=b).logits)
