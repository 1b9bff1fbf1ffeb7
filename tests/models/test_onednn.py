"""fastgrpo.models.onednn: float32 CPU linears on oneDNN. The oneDNN path must equal F.linear (output
and every gradient) to float32 rounding, and every case it does not take must fall back to
F.linear unchanged.

oneDNN is forced on (or off) wherever a test needs it, whatever `auto` picks on this CPU (AMD
with AVX-512 only). Float32 results of oneDNN and MKL differ by CPU-dependent rounding, so they
are not compared with each other: each is held to the float64 result (model_oracle: γ_K·|A||B|
per product; for whole models, the float32 reference's error + a derived tol)."""
import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastgrpo.models import onednn as cpu_gemm
from fastgrpo.models.onednn import MIN_ROWS, FastLinear, OneDNNLinear, linear, use_onednn_linears
from model_oracle import check_fp32, check_gemm, check_model_run, fp32_tol


@pytest.fixture
def force(monkeypatch):
    """Run with the oneDNN path on (`on=True`) or off, whatever this machine's default."""
    def set_(on: bool):
        monkeypatch.setattr(cpu_gemm, "_enabled", lambda: on)
    return set_


@pytest.fixture
def count_apply(monkeypatch):
    calls = []
    real = OneDNNLinear.apply

    def apply(*a):
        calls.append(a[0].shape)
        return real(*a)
    monkeypatch.setattr(OneDNNLinear, "apply", apply)
    return calls


def _grads(fn, x, w, b, g):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = fn(x, w, b)
    y.backward(g)
    return y.detach(), x.grad, w.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("rows,k,n,bias", [(128, 64, 128, True), (300, 64, 32, False), (1726, 128, 64, True),
                                           (129, 17, 5, True)])
def test_matches_f_linear_with_all_gradients(rows, k, n, bias):
    """y = x Wᵀ + b, dx = g W, dW = gᵀ x, db = Σ g: each within γ_K·|A||B| of float64 (K = k + 1,
    n, rows, rows): the bound of any float32 summation order, so of oneDNN on any CPU."""
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen) if bias else None
    g = torch.randn(rows, n, generator=gen)
    y, dx, dw, db = _grads(lambda x, w, b: OneDNNLinear.apply(x, w, b), x, w, b, g)
    assert all(t.dtype == torch.float32 for t in (y, dx, dw) + ((db,) if bias else ()))
    check_gemm("y", y, x, w, b)
    check_gemm("dx", dx, g, w.t())
    check_gemm("dw", dw, g.t(), x.t())
    if bias:
        check_gemm("db", db[None], torch.ones(1, rows), g.t())
    else:
        assert db is None


def test_only_the_inputs_that_need_grad_get_one():
    x, w = torch.randn(200, 8), torch.randn(4, 8, requires_grad=True)
    OneDNNLinear.apply(x, w, None).sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()
    check_gemm("dw", w.grad, torch.ones(4, 200), x.t())
    x2, w2, b2 = torch.randn(200, 8, requires_grad=True), torch.randn(4, 8), torch.randn(4)
    OneDNNLinear.apply(x2, w2, b2).sum().backward()
    check_gemm("dx", x2.grad, torch.ones(200, 4), w2.t())
    assert w2.grad is None and b2.grad is None


def test_linear_dispatch_3d_and_strided_inputs(force, count_apply):
    force(True)
    w, b = torch.randn(32, 16), torch.randn(32)
    x = torch.randn(1, 384, 16)
    y = linear(x, w, b)
    assert y.shape == (1, 384, 32)
    check_gemm("3-D", y[0], x[0], w, b)
    xt = torch.randn(16, 384).t()  # non-contiguous rows
    check_gemm("strided", linear(xt, w, b), xt, w, b)
    assert len(count_apply) == 2 and count_apply[0] == (384, 16)


def test_ladder_bounds_padding_and_shapes(force):
    from fastgrpo.models.onednn import padded_rows

    force(True)
    seen = set()
    for rows in range(1, 70000, 7):
        p = padded_rows(rows)
        assert p >= rows and padded_rows(p) == p  # idempotent: a padded row stays put
        if rows < MIN_ROWS:
            assert p == rows
        elif rows < 1024:
            assert p - rows < 64 and p % 64 == 0
        else:
            assert p - rows <= rows / 16
        seen.add(p)
    for k in range(7, 17):  # bounded shapes: at most 16 row counts per octave
        assert len([p for p in seen if 2 ** k <= p < 2 ** (k + 1)]) <= 16, k
    force(False)
    assert padded_rows(1000) == 1000


@pytest.mark.parametrize("case", ["small", "off-ladder", "bf16", "float64", "autocast", "zero3", "disabled", "empty"])
def test_linear_falls_back_to_f_linear(case, force, count_apply, monkeypatch):
    force(case != "disabled")
    x, w = torch.randn(MIN_ROWS * 2, 16), torch.randn(8, 16)
    if case == "small":
        x = x[: MIN_ROWS - 1]
    elif case == "off-ladder":  # a prefill, say: a new row count would build a new oneDNN primitive
        x = x[: MIN_ROWS + 5]
    elif case == "bf16":
        x, w = x.bfloat16(), w.bfloat16()
    elif case == "float64":
        x, w = x.double(), w.double()
    elif case == "zero3":
        w = nn.Parameter(w)
        w.ds_id = 0  # what DeepSpeed ZeRO-3 marks its partitioned parameters with
    elif case == "empty":
        x = x[:0]
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear(x, w)
        assert y.dtype == torch.bfloat16  # autocast's cast kept
    else:
        y = linear(x, w)
        torch.testing.assert_close(y, F.linear(x, w))
    assert count_apply == []


def test_a_big_product_off_the_ladder_goes_to_onednn(force, count_apply, monkeypatch):
    """The lm_head of a packed batch: a new row count each step, but large enough that building
    a primitive costs less than MKL's AVX2 path loses (BIG_MACS); smaller off-ladder products
    stay on F.linear. Values and both gradients agree with F.linear."""
    import fastgrpo.models.onednn as od

    force(True)
    monkeypatch.setattr(od, "BIG_MACS", (MIN_ROWS + 5) * 16 * 64)
    x = torch.randn(MIN_ROWS + 5, 16, requires_grad=True)  # off the ladder
    w = torch.randn(64, 16, requires_grad=True)
    y = linear(x, w)
    assert count_apply == [(MIN_ROWS + 5, 16)]
    g = torch.randn_like(y)
    y.backward(g)
    check_gemm("y", y, x, w)
    check_gemm("dx", x.grad, g, w.t())
    check_gemm("dw", w.grad, g.t(), x.t())
    linear(x.detach(), torch.randn(63, 16))  # 63 outputs: under the threshold, F.linear
    assert len(count_apply) == 1


def test_nan_inputs_propagate_not_crash(force):
    force(True)
    x = torch.randn(256, 16)
    x[3, 5] = float("nan")
    y = linear(x, torch.randn(8, 16))
    assert torch.isnan(y[3]).all() and torch.isfinite(y[torch.arange(256) != 3]).all()


def test_env_selection(monkeypatch):
    monkeypatch.setenv("FASTGRPO_CPU_GEMM", "mkl")
    assert not cpu_gemm.onednn_enabled()
    monkeypatch.setenv("FASTGRPO_CPU_GEMM", "off")
    assert not cpu_gemm.onednn_enabled()
    monkeypatch.setenv("FASTGRPO_CPU_GEMM", "onednn")
    assert cpu_gemm.onednn_enabled() == cpu_gemm._op_available()
    assert cpu_gemm._op_available()  # every x86 CPU build of torch ships oneDNN
    monkeypatch.setenv("FASTGRPO_CPU_GEMM", "fast please")
    with pytest.raises(ValueError, match="FASTGRPO_CPU_GEMM"):
        cpu_gemm.onednn_enabled()


def _tiny(seed=0):
    from fastgrpo.models.tiny import build_tiny_model

    return build_tiny_model("qwen2", seed=seed, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32)[0]


def _logits_and_grads(m, ids):
    m.zero_grad()
    logits = m(input_ids=ids).logits
    logits.double().logsumexp(-1).sum().backward()
    return {"logits": logits.detach(), **{k: p.grad.clone() for k, p in m.named_parameters()}}


def test_swapped_model_matches_and_keeps_its_identity(force):
    force(True)
    ref = _tiny()
    model = copy.deepcopy(ref)
    exact = copy.deepcopy(ref).double()
    n = use_onednn_linears(model)
    assert n == sum(type(m) is nn.Linear for m in ref.modules()) > 0
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert all(isinstance(m, nn.Linear) for m in model.modules() if isinstance(m, FastLinear))
    assert list(model.state_dict()) == list(ref.state_dict())
    ids = torch.randint(0, ref.config.vocab_size, (2, 100), generator=torch.Generator().manual_seed(1))
    # oneDNN (200 rows: on the ladder) and MKL, each next to the float64 model: logits and gradients
    got, want, truth = (_logits_and_grads(m, ids) for m in (model, ref, exact))
    check_model_run("oneDNN linears", ref.config, 100, 200, got, want, truth)
    # deepcopy / pickle keep the class (the reference model is a deepcopy of the policy)
    assert type(copy.deepcopy(model).lm_head) is FastLinear
    assert type(pickle.loads(pickle.dumps(model)).lm_head) is FastLinear


def test_swap_leaves_subclasses_and_respects_disabled(force):
    class Custom(nn.Linear):
        pass

    m = nn.Sequential(nn.Linear(4, 4), Custom(4, 4))
    force(False)
    assert use_onednn_linears(m) == 0 and type(m[0]) is nn.Linear
    force(True)
    assert use_onednn_linears(m) == 1 and type(m[0]) is FastLinear and type(m[1]) is Custom


def test_build_model_uses_it_where_enabled(force):
    from fastgrpo.trainer.build import build_model
    from fastgrpo.config import load_config

    force(True)
    model, _ = build_model(load_config().model)
    assert type(model.lm_head) is FastLinear
    force(False)
    model, _ = build_model(load_config().model)
    assert type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("share,checkpointing", [(False, False), (True, False), (True, True)])
def test_packed_forward_pads_to_the_ladder_exactly(force, count_apply, share, checkpointing):
    """A swapped model pads its packed row to the ladder (oneDNN shapes) and its log-probs, hidden
    states and every gradient equal the plain model's, which does not pad."""
    import random

    from fastgrpo.models.onednn import padded_rows
    from fastgrpo.models.packed import packed_hidden_states, packed_logprobs
    from fastgrpo.packing import build_packed_batches

    force(True)
    plain = _tiny()
    fast = copy.deepcopy(plain)
    exact = copy.deepcopy(plain).double()
    use_onednn_linears(fast)
    for m in (fast, plain, exact):
        m.train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rng = random.Random(0)
    prompts, comps = [], []
    for k in range(6):
        p = [rng.randrange(3, 40) for _ in range(rng.randint(3, 15))]
        for _ in range(4):
            prompts.append(p)
            comps.append([rng.randrange(3, 40) for _ in range(rng.choice([0, 1, 9, 30, 70]))])
    batch = build_packed_batches(prompts, comps, [0.0] * len(prompts), 10 ** 6, group_size=4, share_prefix=share,
                                 attn_coef=10 ** 6)[0]
    t = batch.input_ids.numel()
    assert padded_rows(t) > t, "the batch must need padding for this test"
    assert (batch.segment_prefix is not None) == share
    coef = torch.randn(batch.targets.numel(), generator=torch.Generator().manual_seed(3))
    out = []
    for m in (fast, plain, exact):
        m.zero_grad()
        count_apply.clear()
        lp = packed_logprobs(m, batch)
        h = packed_hidden_states(m, batch)
        ((lp * coef.to(lp.dtype)).sum() + h.square().mean()).backward()
        out.append(({"logp": lp.detach(), "hidden": h.detach(), **{k: p.grad.clone() for k, p in m.named_parameters()}},
                    list(count_apply)))
    assert out[0][1] and all(s[0] == padded_rows(t) for s in out[0][1])  # fast: every big linear on oneDNN
    assert out[1][1] == [] and out[2][1] == []
    assert out[0][0]["hidden"].shape == out[1][0]["hidden"].shape == (t, 64)
    # padded (oneDNN) and unpadded (MKL), each next to the float64 model
    check_model_run("ladder-padded model", plain.config, _keys(batch), padded_rows(t), out[0][0], out[1][0],
                    out[2][0])


def _keys(batch) -> int:
    """The most positions a packed token attends: its segment and the segment's shared prefix."""
    seg = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
    return seg + (int(batch.segment_prefix[:, 1].max()) if batch.segment_prefix is not None else 0)


def test_torch_compile_traces_the_plain_path(force, count_apply):
    """Inside torch.compile the compiler owns the GEMMs: FastLinear traces as F.linear."""
    force(True)
    m = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    use_onednn_linears(m)
    x = torch.randn(256, 16)
    eager = m(x)
    assert len(count_apply) == 2  # eager: both products on oneDNN
    count_apply.clear()
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    got = compiled(x)
    assert count_apply == []
    # the compiled (torch's GEMM) and the eager (oneDNN) output next to float64: depth 17 + 9
    truth = copy.deepcopy(m).double()(x.double())
    check_fp32("compiled", got, eager, truth, fp32_tol(17 + 9, truth))


def test_strided_and_broadcast_biases(force):
    """oneDNN reads a bias as dense memory: a strided or stride-0 view must be made dense first."""
    force(True)
    x, w = torch.randn(256, 16), torch.randn(8, 16)
    for bias in (torch.randn(16)[::2], torch.tensor(0.5).expand(8)):
        check_gemm("strided bias", linear(x, w, bias), x, w, bias)


def test_double_backward(force):
    """create_graph=True (a gradient penalty): the backward is itself differentiable. oneDNN's
    and F.linear's gradients of the penalty next to float64's (three products deep: y, gx, the
    penalty's backward)."""
    force(True)
    outs = []
    for fn, dtype in ((lambda x, w, b: OneDNNLinear.apply(x, w, b), torch.float32), (F.linear, torch.float32),
                      (F.linear, torch.float64)):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 16, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(8, 16, generator=gen).to(dtype).requires_grad_()
        b = torch.randn(8, generator=gen).to(dtype).requires_grad_()
        y = fn(x, w, b)
        (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        gx.square().sum().backward()
        outs.append({"dw": w.grad.clone(), "db": b.grad.clone()})
    # sums of 17 (y), 8 (gx) and 256 rows (the gradients), twice over in the second backward
    depth = 2 * (17 + 8 + 8 + 256)
    for k in ("dw", "db"):
        check_fp32(k, outs[0][k], outs[1][k], outs[2][k], fp32_tol(depth, outs[2][k]))


def test_auto_takes_amd_avx512_only(monkeypatch):
    monkeypatch.setenv("FASTGRPO_CPU_GEMM", "auto")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu_gemm, "_cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_gemm.onednn_enabled()
    monkeypatch.setattr(cpu_gemm, "_cpu_vendor", lambda: "GenuineIntel")  # MKL runs AVX-512 there
    assert not cpu_gemm.onednn_enabled()
    monkeypatch.setenv("FASTGRPO_CPU_GEMM", "onednn")
    assert cpu_gemm.onednn_enabled()
    monkeypatch.setenv("FASTGRPO_CPU_GEMM", "auto")
    monkeypatch.setattr(cpu_gemm, "_cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not cpu_gemm.onednn_enabled()


def test_half_precision_models_neither_swap_nor_pad(force, count_apply):
    """bf16 linears never take oneDNN here, so they are not swapped, and a float32 model cast
    after the swap is not padded (padding would be pure waste)."""
    from fastgrpo.models.packed import packed_hidden_states
    from fastgrpo.packing import build_packed_batches

    force(True)
    assert use_onednn_linears(_tiny().to(torch.bfloat16)) == 0
    model = _tiny()
    use_onednn_linears(model)
    model.to(torch.bfloat16)
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: seen.append(out.shape[1]))
    batch = build_packed_batches([[5, 6, 7]] * 10, [[8] * 10] * 10, [0.0] * 10, 10 ** 6)[0]
    h = packed_hidden_states(model, batch)
    assert seen == [130] and h.shape == (130, 64) and count_apply == []


def test_attention_refuses_rows_that_disagree_with_cu_seqlens():
    from fastgrpo.models.packed import _varlen_sdpa_attention

    q = torch.randn(1, 2, 10, 8)
    kv = torch.randn(1, 1, 10, 8)
    module = nn.Module()
    with pytest.raises(ValueError, match="cu_seq_lens_q ends at token 8 but the query has 10 rows"):
        _varlen_sdpa_attention(module, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 5, 8]))
    out, _ = _varlen_sdpa_attention(module, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 5, 8]),
                                    fastgrpo_pad_rows=2)
    assert out.shape == (1, 10, 2, 8) and torch.equal(out[0, 8:], torch.zeros(2, 2, 8))


def test_backends_off_cpu_restore_plain_linears(force, monkeypatch):
    """A model headed for an accelerator (here the meta device) gets plain nn.Linear back: the
    oneDNN path would only step aside on every call there."""
    from fastgrpo.trainer import backend as distributed

    force(True)
    model = _tiny()
    assert use_onednn_linears(model) > 0
    monkeypatch.setattr(distributed, "device_for", lambda env: torch.device("meta"))
    distributed.DistributedBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="none")
    assert not any(isinstance(m, FastLinear) for m in model.modules())
    assert not getattr(model, cpu_gemm.ONEDNN_ATTR, False)
