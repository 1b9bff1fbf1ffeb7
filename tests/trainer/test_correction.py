"""Off-policy correction (fastgrpo/correction.py, algorithm.correction): the corrected objective
against a float64 reference written out here (AReaL's decoupled PPO, token-level TIS), the
identity when μ = π_prox, the cap, behav_logp through the packer, the trainer between syncs
(sync.every = 2) with every correction, the on-policy mismatch option, and bad config."""
import math

import pytest
import torch
from trainer_helpers import NoisyTask, stale_trainer

from fastgrpo.config import load_config
from fastgrpo.correction import (apply_correction, behaviour_weights, correction_metrics, correction_sums,
                                 resolve_correction)
from fastgrpo.loss import LossConfig, grpo_loss
from fastgrpo.packing import build_packed_batches

ASYNC_KEYS = {"async/mismatch_kl", "async/is_ess", "async/is_truncated", "async/is_weight_mean"}


def _rollouts(seed, n_seq=7, vocab=23, spread=0.6):
    """Random prompts / completions of odd lengths (one empty completion), a completion mask with
    a forced token, float32 logits of the completion tokens, π_prox near the logits' own
    log-probs and μ further off (so that some behaviour ratios pass a cap of 2)."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, 5, (n_seq,), generator=g).tolist()
    clens = torch.randint(1, 9, (n_seq,), generator=g).tolist()
    clens[2] = 0
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in plens]
    comps = [torch.randint(0, vocab, (c,), generator=g).tolist() for c in clens]
    n = sum(clens)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
    targets = torch.tensor([t for c in comps for t in c], dtype=torch.int64)
    logp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    prox = logp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    behav = prox + spread * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n_seq, generator=g).tolist()
    cmask = [[1] * c for c in clens]
    cmask[0][-1] = 0  # a forced token: no gradient, not counted anywhere

    def split(x):
        out, i = [], 0
        for c in clens:
            out.append(x[i:i + c].float())
            i += c
        return out

    return dict(prompts=prompts, comps=comps, logits=logits.float(), adv=adv, cmask=cmask,
                prox=split(prox), behav=split(behav))


def _reference(logits64, batch, kind, cap, cfg):
    """Float64 objective written out: r = π_θ/π_prox clipped at [1−ε_low, 1+ε_high]; ρ = π_prox/μ;
    decoupled: w = ρ·[ρ ≤ C] (AReaL); tis: w = min(ρ, C); token-mean over the loss mask."""
    lp = torch.log_softmax(logits64, -1).gather(1, batch.targets[:, None])[:, 0]
    m = batch.loss_mask.double()
    prox, behav, a = batch.old_logp.double(), batch.behav_logp.double(), batch.advantages.double()
    r = torch.exp(torch.where(m > 0, lp - prox, 0.0))
    obj = torch.minimum(r * a, r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * a)
    rho = torch.exp(prox - behav)
    w = torch.where(rho <= cap, rho, 0.0) if kind == "decoupled" else rho.clamp(max=cap)
    return (m * w * -obj).sum() / m.sum()


@pytest.mark.parametrize("kind", ["tis", "decoupled"])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_corrected_loss_and_gradient_match_a_float64_reference(kind, share, impl):
    d = _rollouts(seed=3)
    (b,) = build_packed_batches(d["prompts"], d["comps"], d["adv"], 4096, completion_mask=d["cmask"],
                                behav_logp=d["behav"], share_prefix=share)
    # π_prox comes from the trainer's old_logp pass, aligned with the batch's targets
    order = b.seq_index.tolist()
    b.old_logp = torch.cat([d["prox"][i] for i in order])
    perm = torch.cat([torch.arange(sum(len(c) for c in d["comps"][:i]),
                                   sum(len(c) for c in d["comps"][:i + 1])) for i in order])
    cfg = LossConfig(eps_low=0.2, eps_high=0.28)
    sums = apply_correction(b, kind, 2.0)
    assert sums["trunc"] > 0, "the case must exercise the cap"
    logits = d["logits"][perm].clone().requires_grad_(True)
    out = grpo_loss(logits, b.targets, b.advantages, mask=b.loss_mask, old_logp=b.old_logp, weights=b.weights,
                    cu_seqlens=b.loss_cu_seqlens, config=cfg, impl=impl)  # the trainer's call (update._loss_fn)
    out.loss.backward()
    l64 = logits.detach().double().requires_grad_(True)
    ref = _reference(l64, b, kind, 2.0, cfg)
    ref.backward()
    assert float(out.loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-7)
    err = (logits.grad.double() - l64.grad).abs()
    assert float(err.max()) < 1e-6, f"worst token {int(err.max(1).values.argmax())}: {float(err.max())}"


def test_behaviour_equal_to_proximal_changes_nothing():
    """μ = π_prox: every weight is 1, nothing truncated, so the corrected loss and its gradient
    are the uncorrected ones (the proximal clip alone); the metrics read KL 0, ESS 1."""
    d = _rollouts(seed=5)
    (b,) = build_packed_batches(d["prompts"], d["comps"], d["adv"], 4096, completion_mask=d["cmask"],
                                behav_logp=d["prox"], old_logp=d["prox"])
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    grads, losses = [], []
    for kind in (None, "tis", "decoupled"):
        b.weights = None
        if kind:
            m = correction_metrics(apply_correction(b, kind, 2.0))
            assert m == pytest.approx({"async/mismatch_kl": 0.0, "async/is_ess": 1.0, "async/is_truncated": 0.0,
                                       "async/is_weight_mean": 1.0}, abs=1e-12)
        logits = d["logits"].clone().requires_grad_(True)
        out = grpo_loss(logits, b.targets, b.advantages, mask=b.loss_mask, old_logp=b.old_logp, weights=b.weights,
                        cu_seqlens=b.loss_cu_seqlens, config=cfg, impl="torch")
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        grads.append(logits.grad)
    assert losses[1] == losses[0] and losses[2] == losses[0]
    assert torch.equal(grads[1], grads[0]) and torch.equal(grads[2], grads[0])


def test_cap_truncates_or_masks_exactly_the_tokens_above_it():
    rho = torch.tensor([0.5, 1.9, 2.0, 2.1, 10.0, 50.0, 1.0], dtype=torch.float64)
    prox = torch.full((7,), -1.0, dtype=torch.float64)
    behav = prox - torch.log(rho)
    mask = torch.tensor([1, 1, 1, 1, 1, 0, 1.0])  # the 50× token is off the loss mask
    w, trunc = behaviour_weights(prox, behav, "decoupled", 2.0, mask)
    assert trunc.tolist() == [False, False, False, True, True, False, False]
    assert w.tolist() == pytest.approx([0.5, 1.9, 2.0, 0.0, 0.0, 0.0, 1.0])  # w ≤ C kept (AReaL), above: 0
    w, trunc = behaviour_weights(prox, behav, "tis", 2.0, mask)
    assert trunc.tolist() == [False, False, False, True, True, False, False]
    assert w.tolist() == pytest.approx([0.5, 1.9, 2.0, 2.0, 2.0, 0.0, 1.0])
    w, trunc = behaviour_weights(prox, behav, "none", 2.0, mask)
    assert not trunc.any() and w.tolist() == pytest.approx([0.5, 1.9, 2.0, 2.1, 10.0, 0.0, 1.0])
    wt, tt = behaviour_weights(prox, behav, "tis", 2.0, mask)
    m = correction_metrics(correction_sums(prox, behav, wt, tt, mask))
    on = [0.5, 1.9, 2.0, 2.0, 2.0, 1.0]
    kl = sum(r - 1 - math.log(r) for r in [0.5, 1.9, 2.0, 2.1, 10.0, 1.0]) / 6
    assert m["async/is_truncated"] == pytest.approx(2 / 6)
    assert m["async/is_weight_mean"] == pytest.approx(sum(on) / 6)
    assert m["async/is_ess"] == pytest.approx(sum(on) ** 2 / (6 * sum(x * x for x in on)))
    assert m["async/mismatch_kl"] == pytest.approx(kl)
    with pytest.raises(ValueError, match="is_cap"):
        behaviour_weights(prox, behav, "tis", 1.0, mask)


def test_behaviour_logprobs_travel_with_the_packed_batch():
    d = _rollouts(seed=1)
    for share in (False, True):
        batches = build_packed_batches(d["prompts"], d["comps"], d["adv"], 12, behav_logp=d["behav"],
                                       allow_oversize=True, share_prefix=share)
        assert len(batches) > 1
        for b in batches:
            cu = b.loss_cu_seqlens.tolist()
            for s, i in enumerate(b.seq_index.tolist()):
                assert torch.equal(b.behav_logp[cu[s]:cu[s + 1]], d["behav"][i])
            assert b.old_logp is None and b.weights is None
    with pytest.raises(ValueError, match=r"behav_logp\[0\]"):
        build_packed_batches([[1]], [[2, 3]], [1.0], 16, behav_logp=[[0.1]])


def test_auto_is_decoupled_on_the_async_schedule_only():
    assert resolve_correction("auto", async_mode=True) == "decoupled"
    assert resolve_correction("auto", async_mode=False) == "none"
    assert resolve_correction("tis", async_mode=False) == "tis"


# ------------------------------------------------------------------ the trainer


@pytest.mark.parametrize("inner", [1, 2])
@pytest.mark.parametrize("correction", ["none", "tis", "decoupled"])
def test_trainer_between_syncs_corrects_and_logs(cfg_factory, correction, inner):
    """sync.every = 2: step 2 trains rollouts of weights one update old. Every correction logs
    the async/* metrics on that step only; tis / decoupled carry μ as behav_logp, take π_prox as
    the old log-probs (scored at K = 2, the live ones at K = 1: the first inner step's ratio is 1,
    the clip is around π_prox) and weight the tokens by the capped π_prox/μ (stored on the batch
    at K = 2); none keeps μ as the old log-probs (naive PPO)."""
    t, seen = stale_trainer(cfg_factory, f"algorithm.correction={correction}", "algorithm.is_cap=1.5",
                             f"algorithm.inner_steps={inner}")
    logs = [t.step() for _ in range(3)]
    assert not ASYNC_KEYS & set(logs[0]) and not ASYNC_KEYS & set(logs[2])
    assert ASYNC_KEYS <= set(logs[1]), sorted(logs[1])
    m = logs[1]
    assert m["async/mismatch_kl"] > 0 and 0 < m["async/is_ess"] <= 1 and m["async/is_weight_mean"] > 0
    batches, problems, groups = seen[1]
    completion = {(p.id, j): c for p, g in zip(problems, groups) for j, c in enumerate(g)}
    real = [b for b in batches if b is not None]
    for b in real:
        lo = b.loss_cu_seqlens.tolist()
        for s, key in enumerate(b.ids):
            assert b.behav_logp[lo[s]:lo[s + 1]].tolist() == pytest.approx(completion[key].logprobs, abs=1e-6)
        if correction == "none":
            assert b.weights is None and torch.equal(b.old_logp, b.behav_logp)
        elif inner == 1:
            assert b.old_logp is None and b.weights is None  # read from the loss step's logits
        else:
            assert not torch.equal(b.old_logp, b.behav_logp)
            w, _ = behaviour_weights(b.old_logp, b.behav_logp, correction, 1.5, b.loss_mask)
            assert torch.allclose(b.weights, w.float())
            assert float(b.weights.max()) <= 1.5
    if correction == "none":
        assert m["async/is_truncated"] == 0.0
        assert abs(m["loss/ratio_max"] - 1) > 1e-4 or abs(m["loss/ratio_min"] - 1) > 1e-4
    elif inner == 1:  # the logged ratio is the last inner step's: 1 only when there is one
        assert m["loss/ratio_max"] == pytest.approx(1.0, abs=1e-4) and m["loss/ratio_min"] == pytest.approx(1.0, abs=1e-4)
    assert all(b.behav_logp is None and b.weights is None for b in seen[0][0] + seen[2][0] if b is not None)
    t.close()


def test_on_policy_mismatch_correction(cfg_factory):
    """correction_on_policy: an engine in sync with the policy still differs in numerics; the
    step scores π_prox, weights by π_prox/μ (≈ 1 here: same weights, another code path) and logs."""
    from fastgrpo.rollout.torch_engine import TorchEngine
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.grpo import Trainer

    cfg = cfg_factory("steps=1", "algorithm.correction=tis", "algorithm.correction_on_policy=true")
    model, tok = build_model(cfg.model)
    t = Trainer(cfg, model, tok, task=NoisyTask(), engine=TorchEngine(model, tok, copy_model=True), log=lambda m: None)
    logs = t.step()
    assert ASYNC_KEYS <= set(logs)
    assert 0 <= logs["async/mismatch_kl"] < 1e-3 and logs["async/is_ess"] > 0.99
    assert logs["async/is_truncated"] == 0.0
    t.close()


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_live_proximal_logprobs_equal_a_scored_pass(cfg_factory, correction):
    """K = 1: the weights from the loss step's own logits give the same loss and gradient as
    π_prox scored by the old-log-prob pass (an extra forward) and applied to the batch."""
    import copy
    from types import SimpleNamespace

    t, _ = stale_trainer(cfg_factory, f"algorithm.correction={correction}", "algorithm.is_cap=1.5")
    model = t.backend.module
    with torch.no_grad():  # the engine's copy lags the policy: μ ≠ π_prox
        for p in t.engine.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    t._engine_stale = True
    problems = t.curriculum.sample(4)
    groups = t._rollout(problems)
    per_fn, total, dropped = t._score(problems, groups)
    _, adv, keep, _ = t._advantages(problems, per_fn, total, dropped)
    live = [b for b in t._pack(problems, groups, adv, keep) if b is not None]
    t._old_logp(live)
    scored = copy.deepcopy(live)
    scored_sums = {}
    for b in scored:
        b.old_logp = t._logprobs_of(model, b)
        for k, v in apply_correction(b, correction, 1.5).items():
            scored_sums[k] = scored_sums.get(k, 0.0) + v
    totals = {"tokens": float(sum(b.num_loss_tokens for b in live)), "seqs": float(sum(b.num_seqs for b in live))}
    results = []
    for batches in (live, scored):
        t._correction_sums = {k: 0.0 for k in ("n", "w", "w2", "trunc", "kl")}
        t._update_state = SimpleNamespace(nonfinite=False, tokens=0.0, loss=0.0, sums={}, extremes={}, first=True)
        model.zero_grad(set_to_none=True)
        fn = t._loss_fn(totals)
        loss = sum(fn(model, b) for b in batches)
        loss.backward()
        results.append((float(loss.detach()), [p.grad.clone() for p in model.parameters()],
                        correction_metrics(t._correction_sums)))
    (l1, g1, m1), (l2, g2, _) = results
    m2 = correction_metrics(scored_sums)  # the scored path's metrics come from apply_correction
    assert m1["async/mismatch_kl"] > 1e-4 and m1["async/is_truncated"] > 0, m1
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-7)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert m1 == pytest.approx(m2, rel=1e-4, abs=1e-6)
    t.close()


@pytest.mark.parametrize("override, field", [
    ("algorithm.correction=ppo", "algorithm.correction"),
    ("algorithm.is_cap=1.0", "algorithm.is_cap"),
    ("algorithm.is_cap=0.5", "algorithm.is_cap"),
    ("algorithm.correction_on_policy=true", "algorithm.correction_on_policy"),
])
def test_bad_correction_config_names_the_field(override, field):
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"config {field}="), msg


@pytest.mark.slow
def test_async_trainer_corrects_with_decoupled_by_default(tmp_path):
    """rollout.mode=async (Ray local, one built-in-engine worker, η = 1): correction auto is
    decoupled; every step that updates logs the async/* correction metrics and the first inner
    step's ratio is 1 (the clip is around π_prox, not around the worker's μ). On the logical clock
    (rollout.deterministic) step 1 trains groups admitted at version 0, so a stale batch is
    certain; on the wall clock a loaded box could sample every batch fresh (seen once in a full
    suite run: staleness_max 0)."""
    ray = pytest.importorskip("ray")
    from trainer_helpers import TINY

    from fastgrpo.trainer.async_trainer import AsyncTrainer
    from fastgrpo.trainer.build import build_model

    cfg = load_config(None, TINY + ["rollout.mode=async", "sync.timeout=60", "cluster.object_store_mb=100",
                                    "rollout.max_staleness=1", "rollout.deterministic=true", "steps=3",
                                    "optimizer.lr=0.05",
                                    f"logging.out_dir={tmp_path}"])
    model, tok = build_model(cfg.model)
    t = AsyncTrainer(cfg, model, tok, NoisyTask(), log=lambda m: None)
    try:
        assert t._correction() == "decoupled" and t._off_policy()
        logs = [t.step() for _ in range(cfg.steps)]
    finally:
        t.close()
        ray.shutdown()
    updated = [m for m in logs if "loss/ratio_max" in m]
    assert updated and all(ASYNC_KEYS <= set(m) for m in updated)
    assert max(m["async/staleness_max"] for m in logs) >= 1
    for m in updated:
        assert m["loss/ratio_max"] == pytest.approx(1.0, abs=1e-4) and 0 < m["async/is_ess"] <= 1
