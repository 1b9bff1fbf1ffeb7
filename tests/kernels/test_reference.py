"""The oracle itself (kernels/reference.py) against a scalar, loop-per-token transcription of the
loss contract in shared/DESIGN.md written with Python's math module: log-probs, entropy, ratios
(token and sequence level), δ cap, clipping, dual clip, KL estimators, aggregations, metrics."""
import math

import pytest
import torch

from fastgrpo.kernels.contract import LossConfig
from fastgrpo.kernels.reference import grpo_loss_reference, token_logprobs_reference
from kernel_oracle import check_vs_truth, make_batch


def _contract(inp, cfg: LossConfig, num_items=None):
    """loss and per-token log-probs by the contract's formulas, one token at a time."""
    z, y = inp["logits"].tolist(), inp["targets"].tolist()
    cu = inp["cu_seqlens"].tolist()
    m = [float(x != 0) for x in inp["mask"].tolist()]
    tau = cfg.temperature
    logp, ent = [], []
    for row, t in zip(z, y):
        zs = [x / tau for x in row]
        mx = max(zs)
        lse = mx + math.log(sum(math.exp(x - mx) for x in zs))
        logp.append(zs[t] - lse)
        ent.append(-sum(math.exp(x - lse) * (x - lse) for x in zs))
    old, ref = inp["old_logp"].tolist(), inp["ref_logp"].tolist()
    adv, w = inp["advantages"].tolist(), inp["weights"].tolist()
    seqs = [range(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    log_r = [lp - o for lp, o in zip(logp, old)]
    if cfg.ratio_level == "sequence":
        for s in seqs:
            cnt = sum(m[t] for t in s)
            mean = sum(log_r[t] * m[t] for t in s) / max(cnt, 1.0)
            for t in s:
                log_r[t] = mean
    loss_t = []
    for t in range(len(logp)):
        r = math.exp(log_r[t])
        capped = r if cfg.delta is None else min(r, cfg.delta)
        clipped = min(max(r, 1 - cfg.eps_low), 1 + cfg.eps_high)
        obj = min(capped * adv[t], clipped * adv[t])
        if cfg.dual_clip_c is not None and adv[t] < 0:
            obj = max(obj, cfg.dual_clip_c * adv[t])
        d = logp[t] - ref[t]
        kl = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[cfg.kl]
        if cfg.kl_ratio_correction:
            kl *= r
        loss_t.append(-w[t] * obj + cfg.beta * kl - cfg.entropy_coef * ent[t])
    S = len(seqs)
    if cfg.loss_agg == "token-mean":
        loss = sum(l * mm for l, mm in zip(loss_t, m)) / (num_items or max(sum(m), 1.0))
    elif cfg.loss_agg == "seq-mean-token-mean":
        loss = sum(sum(loss_t[t] * m[t] for t in s) / max(sum(m[t] for t in s), 1.0) for s in seqs) / S
    elif cfg.loss_agg == "seq-mean-token-sum":
        loss = sum(loss_t[t] * m[t] for s in seqs for t in s) / S
    else:
        loss = sum(loss_t[t] * m[t] for s in seqs for t in s) / (S * cfg.max_len)
    return loss, logp, ent


CONFIGS = [
    LossConfig(),
    LossConfig(eps_high=0.28, delta=1.4, beta=0.1, kl="k1", loss_agg="seq-mean-token-mean"),
    LossConfig(dual_clip_c=2.0, beta=0.3, kl="k2", temperature=0.7, loss_agg="seq-mean-token-sum"),
    LossConfig(beta=0.05, kl_ratio_correction=True, entropy_coef=0.02, loss_agg="seq-mean-token-sum-norm", max_len=9),
    LossConfig(ratio_level="sequence", eps_low=0.05, eps_high=0.05, beta=0.1, kl_ratio_correction=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_reference_matches_the_written_contract(cfg):
    inp = make_batch(19, 6, seed=23, device="cpu")
    out = grpo_loss_reference(inp["logits"], inp["targets"], inp["advantages"], mask=inp["mask"],
                              old_logp=inp["old_logp"], ref_logp=inp["ref_logp"], weights=inp["weights"],
                              cu_seqlens=inp["cu_seqlens"], config=cfg, return_entropy=True)
    loss, logp, ent = _contract(inp, cfg)
    # the transcription is the truth; both are float64, so there is no same-dtype reference
    for name, got, want in (("loss", out.loss, [loss]), ("logp", out.logp, logp), ("entropy", out.entropy, ent)):
        check_vs_truth(name, got, None, torch.tensor(want, dtype=torch.float64), torch.float64)


def test_reference_num_items_and_metrics():
    inp = make_batch(15, 4, seed=29, spread=0.6, device="cpu")
    cfg = LossConfig(eps_low=0.1, eps_high=0.2, beta=0.1)
    out = grpo_loss_reference(inp["logits"], inp["targets"], inp["advantages"], mask=inp["mask"],
                              old_logp=inp["old_logp"], ref_logp=inp["ref_logp"], weights=inp["weights"],
                              cu_seqlens=inp["cu_seqlens"], config=cfg, num_items=50)
    want = torch.tensor(_contract(inp, cfg, num_items=50)[0], dtype=torch.float64)
    check_vs_truth("loss", out.loss, None, want, torch.float64)
    on = inp["mask"] != 0
    r = torch.exp(out.logp - inp["old_logp"])[on]
    a = inp["advantages"][on]
    assert out.metrics["clip_frac_low"].item() == pytest.approx(float(((r < 0.9) & (a < 0)).double().mean()), abs=1e-6)
    assert out.metrics["clip_frac_high"].item() == pytest.approx(float(((r > 1.2) & (a > 0)).double().mean()), abs=1e-6)
    assert out.metrics["ratio_max"].item() == pytest.approx(float(r.max()), rel=1e-6)
    assert out.metrics["clip_frac_low"].item() > 0 and out.metrics["clip_frac_high"].item() > 0


def test_token_logprobs_reference_at_temperature():
    x = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    logp, ent = token_logprobs_reference(x, torch.tensor([2, 0]), temperature=2.0, return_entropy=True)
    z = [0.5, 1.0, 1.5]
    lse = math.log(sum(math.exp(v) for v in z))
    assert logp.tolist() == pytest.approx([1.5 - lse, -math.log(3)], abs=1e-14)
    assert ent[1].item() == pytest.approx(math.log(3), abs=1e-14)
