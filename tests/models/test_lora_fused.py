"""Fast paths under LoRA (issue 24): the fused CPU decoder layers and the oneDNN linears take a
PEFT LoRA'd linear (the base GEMM + the low-rank product, gradients for A and B only), checked
against the float64 model like every fused path (model_oracle's rule: the path under test's error
≤ the model's own float32 layers' error + tol); what they cannot take falls back, said once."""
import copy
import warnings

import pytest
import torch

from fastgrpo.config.lora import LoRAConfig
from fastgrpo.models import fused_layer as FL
from fastgrpo.models import lora
from fastgrpo.models import onednn as cpu_gemm
from fastgrpo.models.packed import packed_hidden_states, packed_logprobs
from model_oracle import check_model_run
from test_fused_layer import _batch, _keys, _model


@pytest.fixture
def count_fused(monkeypatch):
    calls = []
    real = FL._DecoderLayerFn.apply

    def apply(*a):
        calls.append(len(a))
        return real(*a)
    monkeypatch.setattr(FL._DecoderLayerFn, "apply", apply)
    return calls


def _lora_model(arch, targets=(), rank=4, dropout=0.0, **kw):
    model = _model(arch, **kw)
    lora.attach_lora(model, LoRAConfig(rank=rank, alpha=8.0, dropout=dropout, target_modules=list(targets)))
    with torch.no_grad():  # a trained-looking adapter (PEFT starts B at 0: the product would vanish)
        gen = torch.Generator().manual_seed(7)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def _run(model, batch, coef):
    model.zero_grad()
    lp = packed_logprobs(model, batch)
    h = packed_hidden_states(model, batch)
    ((lp * coef.to(lp.dtype)).sum() + h.square().mean()).backward()
    grads = {k: p.grad.double() for k, p in model.named_parameters() if p.grad is not None}
    return {"logp": lp.detach().double(), "hidden": h.detach().double(), **grads}


@pytest.mark.parametrize("arch,targets,share,dnn", [
    ("qwen2", (), False, False),
    ("qwen2", ("q_proj", "v_proj", "down_proj"), True, True),
    ("llama", (), True, False),
    ("qwen3", ("k_proj", "o_proj", "up_proj"), False, True),
])
def test_fused_lora_equals_the_float64_model(monkeypatch, count_fused, arch, targets, share, dnn):
    monkeypatch.setattr(cpu_gemm, "_enabled", lambda: dnn)
    base = _lora_model(arch, targets, nq=4 if arch == "qwen3" else 2, nk=2 if arch == "qwen3" else 1,
                       d=16 if arch == "qwen3" else 32)
    exact = copy.deepcopy(base).double()
    ref = copy.deepcopy(base)  # PEFT's own layers around the model's own float32 layers
    fused = copy.deepcopy(base)
    cpu_gemm.use_onednn_linears(ref)
    cpu_gemm.use_onednn_linears(fused)
    assert FL.use_fused_layers(fused) == 2  # LoRA'd layers are swapped (no longer left alone)
    batch = _batch(share)
    coef = torch.randn(batch.targets.numel(), generator=torch.Generator().manual_seed(3))
    for m in (exact, ref, fused):
        m.train()
    got = _run(fused, batch, coef)
    assert len(count_fused) == 4 and all(n > 23 for n in count_fused)  # 2 layers × 2 forwards, with adapter args
    count_fused.clear()
    want = _run(ref, batch, coef)
    assert count_fused == []
    truth = _run(exact, batch, coef)
    # the base is frozen: only the adapter (A and B of every wrapped projection) has gradients
    assert set(got) - {"logp", "hidden"} == {k for k, p in fused.named_parameters() if p.requires_grad}
    assert all(".lora_" in k for k in set(got) - {"logp", "hidden"})
    n_wrapped = 2 * (len(targets) or 7)
    assert len(set(got) - {"logp", "hidden"}) == 2 * n_wrapped
    check_model_run("fused-lora", fused.config, _keys(batch), batch.input_ids.numel(), got, want, truth)


def test_fused_lora_with_the_adapter_disabled_is_the_base(count_fused):
    model = _lora_model("qwen2")
    plain = _model("qwen2")  # the same base weights, no adapter
    FL.use_fused_layers(model)
    FL.use_fused_layers(plain)
    batch = _batch(False)
    with torch.no_grad():
        with lora.adapter_disabled(model):
            off = packed_hidden_states(model, batch)
        on = packed_hidden_states(model, batch)
        want = packed_hidden_states(plain, batch)
    assert len(count_fused) == 6
    assert torch.equal(off, want)  # the same kernels on the same weights: bit-identical
    assert (on - want).abs().max() > 1e-3


def test_dropout_while_training_falls_back_once_and_eval_is_fused(count_fused):
    model = _lora_model("qwen2", dropout=0.1)
    FL.use_fused_layers(model)
    batch = _batch(False)
    model.train()
    lora._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="adapter dropout 0.1 while training"):
        packed_hidden_states(model, batch).sum().backward()
    assert count_fused == []  # PEFT's own layers ran
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not per call
        packed_hidden_states(model, batch)
    model.eval()  # no dropout in eval (old / reference log-probs): fused
    with torch.no_grad():
        packed_hidden_states(model, batch)
    assert len(count_fused) == 2


def test_onednn_takes_a_lora_linear(monkeypatch):
    """The oneDNN linear under a PEFT wrapper: the base GEMM on oneDNN (a FastLinear base layer), the
    adapter's small products beside it; outputs and the adapter's gradients against float64."""
    monkeypatch.setattr(cpu_gemm, "_enabled", lambda: True)
    if not cpu_gemm._op_available():
        pytest.skip("oneDNN's linear op is not in this torch build")
    model = _lora_model("qwen2")
    exact = copy.deepcopy(model).double()
    assert cpu_gemm.use_onednn_linears(model) > 0
    q = model.model.layers[0].self_attn.q_proj
    assert type(q.base_layer) is cpu_gemm.FastLinear and q.base_layer.weight.requires_grad is False
    calls = []
    real = cpu_gemm.OneDNNLinear.apply
    monkeypatch.setattr(cpu_gemm.OneDNNLinear, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(192, 64, generator=torch.Generator().manual_seed(1))
    y = q(x)
    y.square().sum().backward()
    assert calls
    xe = x.double()
    qe = exact.model.layers[0].self_attn.q_proj
    ye = qe(xe)
    ye.square().sum().backward()
    a = q.lora_A["default"].weight
    tol = 64 * 2 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(y.double(), ye, rtol=tol, atol=tol * ye.abs().max().item())
    ga, gae = a.grad.double(), qe.lora_A["default"].weight.grad
    torch.testing.assert_close(ga, gae, rtol=1e-4, atol=1e-4 * gae.abs().max().item())
    assert q.base_layer.weight.grad is None


def test_lora_attached_after_the_swap_is_taken(count_fused):
    """PEFT wrapping the projections of an already fused model (TRL's peft_config path): the layer
    still runs fused, with the adapter, and agrees with PEFT's own layers."""
    fused = _model("qwen2")
    ref = _model("qwen2")
    assert FL.use_fused_layers(fused) == 2
    for m in (fused, ref):
        torch.manual_seed(0)
        lora.attach_lora(m, LoRAConfig(rank=2))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.fill_(0.05)
    batch = _batch(False)
    got = packed_hidden_states(fused, batch)
    assert len(count_fused) == 2
    want = packed_hidden_states(ref, batch)
    assert count_fused == [33, 33]  # ref: PEFT's layers around the model's own (no fused calls)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_lora_with_gradient_checkpointing_trains_the_adapter(tmp_path):
    from fastgrpo.config import load_config
    from fastgrpo.trainer.build import build_model

    cfg = load_config(None, ["model.lora.rank=2", "model.gradient_checkpointing=true"])
    model, _ = build_model(cfg.model)
    model.train()
    batch = _batch(False)
    packed_hidden_states(model, batch).square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in n for n in grads)
    assert any(g is not None and float(g.abs().sum()) > 0 for n, g in grads.items() if "lora_B" in n)
