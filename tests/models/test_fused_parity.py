"""Fused vs unfused GRPO training, Liger-Kernel style: two identical float32 tiny models (same
seed), one with fastgrpo's fast paths patched in (fused decoder layers, with oneDNN linears and
without: forced both ways, since `auto` takes oneDNN on AMD CPUs with AVX-512 only and each
path must be tested on every CPU; `build_model` as the trainer uses it) and one unpatched (the
model's own layers, `nn.Linear`), take 5 AdamW steps each through the trainer's own update
(`Trainer._old_logp` + `Trainer._update`: packed forward → grpo_loss → backward over its
micro-batches → clip → fused AdamW) on the same packed rollout batch. After every step the
losses, the gradients and every parameter must agree to float32 rounding (tolerances derived
below).

One rollout batch (8 prompts × G = 8 of `NoisyTask`, whose reward varies within the groups)
drawn once from the fused model, then inner_steps = 5 updates on it against the old log-probs
each trainer scores before its first update (PPO's K inner steps), so the importance ratio moves
away from 1 and the loss depends on the policy. The clip range is widened (eps 0.95 / 10) so that
no token's ratio sits at a clip edge, where one ulp decides whether its gradient counts at all
(a discontinuity no rounding tolerance can cover); the test asserts that nothing was clipped.

Tolerances (u = 2⁻²⁴, the float32 unit roundoff; T ≈ 1000 packed tokens; lr = 5e-4; 5 steps):
- Gradients. The two models compute the same float32 function with sums in other orders (C++
  loops, oneDNN or MKL GEMMs against ATen's), so each result carries its own rounding. A weight
  gradient element sums T token terms, and the rounding errors of a sum add like a random walk:
  |Δg| ≈ √T·u·rms(g) ≈ 2e-6 of the tensor's gradient scale, ×10 for the depth of the backward
  chain (norms, softmax, attention): 2e-5. Check: |Δg| ≤ 1e-3·max|g| per tensor (50× over;
  measured ≤ 1.2e-5 over 8 seeds × {oneDNN, MKL} GEMMs, the later steps' drift included). A
  wrong gradient (a term missing, a wrong factor) is off by O(1e-2 … 1) of the scale.
- Parameters. AdamW's step lr·m̂/(√v̂ + ε) is scale-free per element: a relative gradient error
  δ ≈ 2e-5 moves an element by ≤ 2δ·lr per step, 2e-4·lr over 5 steps. Where a gradient
  cancels to |g| ≲ ε its absolute error counts instead, amplified up to lr·|Δg|/ε (the slope of
  g/(|g| + ε) at 0), with |Δg| ≈ √T·u·rms(g) ≈ 6e-9 (rms(g) ≲ 5e-3 on this model): at the
  default ε = 1e-8 up to 0.6·lr, as much as a bug (measured up to 0.02·lr: few elements come
  that close to 0), so the test runs AdamW with ε = 1e-6 (optimizer.eps): 6e-3·lr, 0.02·lr at
  3σ over the ~20 elements (a fraction ≈ ε/rms(g) of 80k) that small. Such an error enters once,
  at the step where that gradient is that small, and stays (later steps add relative errors).
  Check: atol 0.1·lr (4× over 0.02·lr + 2e-4·lr; measured ≤ 2.4e-3·lr) + rtol 5·2u (θ's own
  rounding, ≤ one ulp per step). A wrong gradient moves elements by ~lr per step (Adam steps
  ≈ lr·sign(g)), ≥ 10× the tolerance: the negative control below injects a 1 % error into the
  fused layers' input gradient, and parameters then differ by up to 2·lr after one step. A
  gradient wrong by a constant factor only, which Adam's scale-freedom hides from the
  parameters, fails the gradient check.
- Loss: a token mean of A·r, r = exp(logp − old logp). The per-token log-probs of the two
  forwards (the old ones too) agree to a few ulp of |logp| ≲ 10, ≤ 2e-6 (measured 1e-6), so
  |Δloss| ≤ mean|A·r|·2·2e-6 ≈ 5e-6 (mean|A·r| ≲ 1.2) even with every error of one sign:
  atol 2e-5 (measured ≤ 5e-8).
"""
import copy

import pytest
import torch

from fastgrpo.config import load_config
from fastgrpo.models import fused_layer as FL
from fastgrpo.models import onednn as cpu_gemm
from fastgrpo.models.packed import VARLEN_ATTN
from fastgrpo.models.patch import unpatch_model
from fastgrpo.trainer.build import build_model
from fastgrpo.tasks.arithmetic import ArithmeticTask
from fastgrpo.trainer.grpo import Trainer

U = 2.0 ** -24
STEPS = 5
LR = 5e-4
PARAM_ATOL = 0.1 * LR
PARAM_RTOL = STEPS * 2 * U
GRAD_REL = 1e-3  # of the tensor's max |g|
LOSS_ATOL = 2e-5

OVERRIDES = [
    "threads=1", "seed=0", "steps=1", "sft_first=false", "rollout.engine=torch",
    # the demo's model (hidden 64, 2 layers, 2 heads of 32, one KV head)
    "model.hidden_size=64", "model.num_hidden_layers=2", "model.intermediate_size=128",
    "model.num_attention_heads=2",
    "data.max_operand=10", "data.num_heldout=10",
    "rollout.group_size=8", "rollout.prompts_per_step=8", "rollout.max_new_tokens=16",
    f"algorithm.inner_steps={STEPS}", "algorithm.eps_low=0.95", "algorithm.eps_high=10.0",
    f"optimizer.lr={LR}", "optimizer.schedule=constant", "optimizer.eps=1e-6",
    "packing.max_tokens=384",  # several micro-batches (whole groups of ~120 tokens): gradients accumulate
    "logging.progress=false", "logging.tensorboard=false", "logging.plots=false",
    "checkpoint.every=0", "checkpoint.at_end=false",
]


class NoisyTask(ArithmeticTask):
    """Arithmetic prompts whose 'accuracy' is 1 when a completion holds a digit 1..4: true for some
    samples of an untrained model and not others, so every group has σ > 0 and a gradient
    (tests/trainer/trainer_helpers.py's NoisyTask, without its failure modes)."""

    def __init__(self):
        super().__init__(10, 10, 0)

    def reward_fns(self):
        def acc(completions, answers):
            return [float(any(d in c for d in "1234")) for c in completions]

        def fmt(completions, answers):
            return [0.5] * len(completions)

        return {"accuracy": acc, "format": fmt}


class _CountingOps:
    """The fused layers' C++ ops module, counting the calls of each op."""

    def __init__(self, ops, counts):
        self._ops, self._counts = ops, counts

    def __getattr__(self, name):
        fn = getattr(self._ops, name)

        def call(*a, **kw):
            self._counts[name] = self._counts.get(name, 0) + 1
            return fn(*a, **kw)
        return call


@pytest.fixture
def probes(monkeypatch):
    """Counters of the fused path: decoder-layer autograd calls (their row counts), the C++ ops
    and oneDNN products."""
    monkeypatch.setenv("FASTGRPO_FUSED_LAYERS", "1")
    real_ops = FL.ops_module()
    assert real_ops is not None, "the fused layers must build on the test machine"
    p = {"rows": [], "ops": {}, "onednn": 0}
    monkeypatch.setattr(FL, "ops_module", lambda: _CountingOps(real_ops, p["ops"]))
    real_apply = FL._DecoderLayerFn.apply

    def apply(*a):
        p["rows"].append(a[0].shape[0])
        return real_apply(*a)
    monkeypatch.setattr(FL._DecoderLayerFn, "apply", apply)
    real_mm = cpu_gemm._mm

    def mm(*a, **kw):
        p["onednn"] += 1
        return real_mm(*a, **kw)
    monkeypatch.setattr(cpu_gemm, "_mm", mm)
    n = torch.get_num_threads()
    yield p
    torch.set_num_threads(n)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _train(trainer, batches):
    """The trainer's update on its own copy of `batches`; per optimizer step: (loss, gradients
    before the step, parameters after it). Returns them and the update's logs."""
    model = trainer.backend.module
    steps = []
    step = trainer.backend.step

    def recording_step(accept=None):
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        norm = step(accept=accept)
        steps.append((trainer._update_state.loss, grads, _snapshot(model), norm))
        return norm

    trainer.backend.step = recording_step
    own = copy.deepcopy(batches)
    trainer._old_logp(own)  # each trainer scores its own old log-probs (K > 1)
    logs = trainer._update(own)
    return steps, logs


def _train_pair(tmp_path, probes, monkeypatch, dnn: bool, inject=None):
    monkeypatch.setattr(cpu_gemm, "_enabled", lambda: dnn)  # whatever `auto` picks on this CPU
    cfgs = [load_config(None, OVERRIDES + [f"logging.out_dir={tmp_path / name}"]) for name in ("fused", "plain")]
    fused, tok = build_model(cfgs[0].model)
    plain, _ = build_model(cfgs[1].model)
    unpatch_model(plain)
    assert getattr(fused, FL.FUSED_ATTR, False)
    assert type(fused.model.layers[0]).__name__ == "FusedQwen2DecoderLayer"
    assert type(plain.model.layers[0]).__name__ == "Qwen2DecoderLayer"
    assert any(type(m) is cpu_gemm.FastLinear for m in fused.modules()) == dnn
    assert not any(type(m) is cpu_gemm.FastLinear for m in plain.modules())
    init = _snapshot(plain)
    assert all(torch.equal(v, init[k]) for k, v in fused.named_parameters())  # identical models

    trainers = [Trainer(cfg, m, tok, task=NoisyTask(), log=lambda msg: None) for cfg, m in ((cfgs[0], fused),
                                                                                          (cfgs[1], plain))]
    try:
        r = trainers[0]._round(cfgs[0].rollout.prompts_per_step)
        assert int(r.keep.sum()) >= 4, "NoisyTask's rewards vary within (nearly) every group"
        batches = trainers[0]._pack(r.problems, r.groups, r.adv, r.keep)
        assert len(batches) >= 2 and all(b is not None for b in batches)
        probes["rows"].clear(), probes["ops"].clear()
        probes["onednn"] = 0
        if inject is not None:
            inject()
        fused_run = _train(trainers[0], batches)
        fused_probes = copy.deepcopy(probes)
        probes["rows"].clear(), probes["ops"].clear()
        probes["onednn"] = 0
        seen = []
        h = plain.model.layers[0].register_forward_pre_hook(
            lambda mod, args, kw: seen.append("cu_seq_lens_q" in kw), with_kwargs=True)
        plain_run = _train(trainers[1], batches)
        h.remove()
    finally:
        for t in trainers:
            t.close()

    # the fused model took the fused path: every decoder layer of every packed forward (the old
    # log-probs' and the 5 updates', each over every micro-batch), forward and backward C++ ops,
    # on oneDNN's ladder-padded rows where this CPU takes oneDNN; the unfused model none of it,
    # but the packed varlen forward
    layers = len(fused.model.layers)
    assert len(fused_probes["rows"]) == layers * len(batches) * (1 + STEPS)
    want_rows = {cpu_gemm.padded_rows(b.input_ids.numel()) for b in batches}
    assert set(fused_probes["rows"]) == want_rows
    for op in ("rmsnorm_fwd", "attn_fwd", "silu_mul_fwd", "rmsnorm_bwd", "attn_bwd", "silu_mul_bwd"):
        assert fused_probes["ops"].get(op, 0) > 0, op
    assert (fused_probes["onednn"] > 0) == dnn
    assert probes["rows"] == [] and probes["ops"] == {} and probes["onednn"] == 0
    assert seen and all(seen) and plain.config._attn_implementation == VARLEN_ATTN
    return init, fused_run, plain_run


def _param_mismatch(a, b):
    """(name, max |Δ| / lr) of the worst parameter beyond the tolerance, or None."""
    worst = None
    for k in b:
        d = (a[k] - b[k]).abs()
        bad = d > PARAM_ATOL + PARAM_RTOL * b[k].abs()
        if bool(bad.any()) and (worst is None or d.max() / LR > worst[1]):
            worst = (k, float(d.max()) / LR)
    return worst


@pytest.mark.parametrize("dnn", [True, False], ids=["onednn", "torch-gemm"])
def test_fused_and_unfused_models_train_alike(tmp_path, probes, monkeypatch, dnn):
    init, (fused_steps, fused_logs), (plain_steps, plain_logs) = _train_pair(tmp_path, probes, monkeypatch, dnn)
    assert len(fused_steps) == len(plain_steps) == STEPS
    for logs in (fused_logs, plain_logs):
        assert "train/skipped" not in logs
        # nothing clipped: no token at a clip edge (see the module doc); the ratio did move
        assert logs["loss/clip_frac_low"] == logs["loss/clip_frac_high"] == 0.0
        assert logs["loss/ratio_min"] < 0.99 and logs["loss/ratio_max"] > 1.01
    for i, ((lf, gf, pf, nf), (lp, gp, pp, np_)) in enumerate(zip(fused_steps, plain_steps), 1):
        assert abs(lf - lp) <= LOSS_ATOL, f"step {i}: loss {lf!r} fused vs {lp!r} unfused"
        assert abs(nf - np_) <= GRAD_REL * np_, f"step {i}: grad norm {nf} vs {np_}"
        for k in gp:
            scale = float(gp[k].abs().max())
            torch.testing.assert_close(gf[k], gp[k], rtol=0, atol=GRAD_REL * scale, msg=lambda m: f"step {i} grad {k}: {m}")
        assert set(pf) == set(pp) == set(init)
        for k in pp:
            torch.testing.assert_close(pf[k], pp[k], rtol=PARAM_RTOL, atol=PARAM_ATOL,
                                       msg=lambda m: f"step {i} parameter {k}: {m}")
    # a non-trivial change: the loss fell, and every parameter moved by many tolerances (Adam:
    # ≈ lr per element and step)
    losses = [s[0] for s in plain_steps]
    assert losses[-1] < losses[0] - 100 * LOSS_ATOL, losses
    last = plain_steps[-1][2]
    for k in init:
        moved = float((last[k] - init[k]).abs().max())
        assert moved > 20 * PARAM_ATOL, f"{k} moved by only {moved / LR:.2f} lr in {STEPS} steps"


def test_a_wrong_gradient_is_caught(tmp_path, probes, monkeypatch):
    """Negative control: a 1 % error in the fused layers' input gradient (a bug of the kind the
    test is for) puts parameters beyond the tolerance after the first step."""
    real_backward = FL._DecoderLayerFn.backward

    def inject():
        def backward(ctx, gy):
            g = list(real_backward(ctx, gy))
            g[0] = g[0] * 0.99
            return tuple(g)
        monkeypatch.setattr(FL._DecoderLayerFn, "backward", staticmethod(backward))

    _, (fused_steps, _), (plain_steps, _) = _train_pair(tmp_path, probes, monkeypatch, True, inject=inject)
    worst = _param_mismatch(fused_steps[0][2], plain_steps[0][2])
    assert worst is not None and worst[1] > 0.5, worst
