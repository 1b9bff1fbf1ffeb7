"""Fused float32 CPU decoder layers (fastgrpo.models.fused_layer): equal to the model's own layers (in
float64) in outputs and every gradient, and the model's own layers wherever they do not apply.

The fused C++ loops (-march=native), oneDNN or torch's GEMMs and the model's own float32 layers
round differently, and differently on each CPU: a float32 result of one path is never compared
with another's, but each with the float64 model next to the model's own float32 layers
(model_oracle.check_model_run). Results of one path on one input are bit-identical and compared
exactly."""
import copy
import pickle
import random

import pytest
import torch

from fastgrpo.models import onednn as cpu_gemm
from fastgrpo.models import fused_layer as FL
from fastgrpo.models.packed import packed_hidden_states, packed_logprobs
from fastgrpo.packing import build_packed_batches
from model_oracle import check_fp32, check_model_run, fp32_tol, train_depth


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert FL.ops_module() is not None, "the fused layers must build on the test machine"


@pytest.fixture
def count_fused(monkeypatch):
    calls = []
    real = FL._DecoderLayerFn.apply

    def apply(*a):
        calls.append(a[0].shape[0])
        return real(*a)
    monkeypatch.setattr(FL._DecoderLayerFn, "apply", apply)
    return calls


def _model(arch="qwen2", nq=2, nk=1, d=32, hidden=64, seed=0, **kw):
    from fastgrpo.models.tiny import build_tiny_model

    if arch == "qwen3":  # not one of the demo's architectures: built from its config here
        from transformers import AutoModelForCausalLM, Qwen3Config

        cfg = Qwen3Config(vocab_size=48, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=nq,
                          num_key_value_heads=nk, head_dim=d, intermediate_size=128, rms_norm_eps=1e-6,
                          tie_word_embeddings=True, max_position_embeddings=512, pad_token_id=0, **kw)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    else:
        model, _ = build_tiny_model(arch, seed=seed, hidden_size=hidden, num_attention_heads=nq,
                                    num_key_value_heads=nk, head_dim=d, vocab_size=48, **kw)
    with torch.no_grad():  # non-trivial norm weights and biases
        gen = torch.Generator().manual_seed(seed + 1)
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def _batch(share: bool, seed=0, group=4, n_groups=6, lens=(0, 1, 9, 30, 70)):
    rng = random.Random(seed)
    prompts, comps = [], []
    for _ in range(n_groups):
        p = [rng.randrange(3, 40) for _ in range(rng.randint(3, 15))]
        for _ in range(group):
            prompts.append(p)
            comps.append([rng.randrange(3, 40) for _ in range(rng.choice(lens))])
    b = build_packed_batches(prompts, comps, [0.0] * len(prompts), 10 ** 6, group_size=group, share_prefix=share,
                             attn_coef=10 ** 6)[0]
    assert (b.segment_prefix is not None) == share
    return b


def _run(model, batch, coef):
    model.zero_grad()
    lp = packed_logprobs(model, batch)
    h = packed_hidden_states(model, batch)
    ((lp * coef.to(lp.dtype)).sum() + h.square().mean()).backward()
    return lp.detach().double(), h.detach().double(), {k: p.grad.double() for k, p in model.named_parameters()}


def _tensors(run):
    lp, h, grads = run
    return {"logp": lp, "hidden": h, **grads}


def _keys(batch) -> int:
    """The most positions a packed token attends: its segment and the segment's shared prefix."""
    seg = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
    return seg + (int(batch.segment_prefix[:, 1].max()) if batch.segment_prefix is not None else 0)


def _check(name, model, batch, got, ref, truth):
    """Output / gradient dicts of the path under test and the float32 reference next to float64."""
    check_model_run(name, model.config, _keys(batch), batch.input_ids.numel(), got, ref, truth)


def _hidden_and_grads(model, batch):
    """The packed hidden states and (from their sum) every gradient, as float64."""
    model.zero_grad()
    h = packed_hidden_states(model, batch)
    h.sum().backward()
    return {"hidden": h.detach().double(),
            **{k: p.grad.double() for k, p in model.named_parameters() if p.grad is not None}}


@pytest.mark.parametrize("arch,nq,nk,d,share,ckpt,dnn", [
    ("qwen2", 2, 1, 32, False, False, True),
    ("qwen2", 2, 1, 32, True, False, True),
    ("qwen2", 2, 1, 32, True, True, False),
    ("qwen2", 4, 2, 16, True, False, False),
    ("llama", 2, 2, 32, False, False, True),
    ("llama", 4, 1, 16, True, True, True),
    ("qwen3", 4, 2, 16, True, False, True),
    ("qwen3", 2, 1, 32, False, True, False),
    ("qwen3", 2, 1, 32, True, "reentrant", True),  # its first forward runs under no_grad
])
def test_fused_equals_the_float64_model(monkeypatch, count_fused, arch, nq, nk, d, share, ckpt, dnn):
    monkeypatch.setattr(cpu_gemm, "_enabled", lambda: dnn)
    exact = _model(arch, nq, nk, d).double()
    ref = _model(arch, nq, nk, d)  # the model's own float32 layers (with the same GEMMs)
    fused = _model(arch, nq, nk, d)
    cpu_gemm.use_onednn_linears(ref)
    cpu_gemm.use_onednn_linears(fused)
    assert FL.use_fused_layers(fused) == 2
    assert type(fused.model.layers[0]).__name__ == f"Fused{type(exact.model.layers[0]).__name__}"
    assert type(fused.model.norm).__name__.startswith("Fused")
    for m in (exact, ref, fused):
        m.train()
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    batch = _batch(share)
    coef = torch.randn(batch.targets.numel(), generator=torch.Generator().manual_seed(3))
    got = _run(fused, batch, coef)
    # every layer of every forward fused (checkpointing recomputes them in the backward)
    assert len(count_fused) == 2 * 2 * (2 if ckpt else 1)
    if dnn:  # the row was padded to oneDNN's ladder
        assert set(count_fused) == {cpu_gemm.padded_rows(batch.input_ids.numel())}
    count_fused.clear()
    want = _run(ref, batch, coef)
    assert count_fused == []
    _check("fused", fused, batch, _tensors(got), _tensors(want), _tensors(_run(exact, batch, coef)))


def test_model_own_layers_outside_packed_training_forwards(count_fused):
    """A plain (padded) forward, generate, bf16 models, hooks, torch.compile and the off switch keep
    the model's own layers; outputs stay the unswapped model's."""
    plain = _model()
    fused = copy.deepcopy(plain)
    assert FL.use_fused_layers(fused) == 2
    ids = torch.randint(3, 40, (3, 11))
    torch.testing.assert_close(fused(ids).logits, plain(ids).logits, rtol=0, atol=0)
    out = fused.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain.generate(ids[:1], max_new_tokens=4, do_sample=False))
    assert count_fused == []
    batch = _batch(False)
    # a forward hook on a part: the fused path would skip it, so the layer stays the model's
    seen = []
    h = fused.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: seen.append(1))
    packed_hidden_states(fused, batch)
    h.remove()
    assert seen == [1] and len(count_fused) == 1  # layer 0 fused, layer 1 (hooked) not
    assert FL.use_fused_layers(copy.deepcopy(plain).to(torch.bfloat16)) == 0  # not swapped
    bf16 = copy.deepcopy(fused).to(torch.bfloat16)  # cast after the swap: bf16 forwards take the model's layers
    count_fused.clear()
    packed_hidden_states(bf16, batch)
    assert count_fused == []


def test_off_switch_and_restore(monkeypatch):
    plain = _model()
    monkeypatch.setenv("FASTGRPO_FUSED_LAYERS", "0")
    assert FL.use_fused_layers(copy.deepcopy(plain)) == 0
    monkeypatch.setenv("FASTGRPO_FUSED_LAYERS", "1")
    m = copy.deepcopy(plain)
    FL.use_fused_layers(m)
    assert getattr(m, FL.FUSED_ATTR)
    assert FL.restore_layers(m) == 2
    assert type(m.model.layers[0]) is type(plain.model.layers[0])
    assert type(m.model.norm) is type(plain.model.norm)
    assert not hasattr(m, FL.FUSED_ATTR) and not hasattr(m.model.layers[0], "_fastgrpo_parts")
    monkeypatch.setenv("FASTGRPO_FUSED_LAYERS", "sometimes")
    with pytest.raises(ValueError, match="FASTGRPO_FUSED_LAYERS"):
        FL.use_fused_layers(m)


def test_deepcopy_pickle_state_dict(count_fused):
    fused = _model()
    FL.use_fused_layers(fused)
    keys = set(_model().state_dict())
    assert set(fused.state_dict()) == keys
    # (pickled before any forward: transformers' own output recorder, installed by the first
    # forward that asks for hidden states, is a local function that pickle refuses)
    others = (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused)))
    batch = _batch(True)
    want = packed_hidden_states(fused, batch)
    for other in others:
        assert type(other.model.layers[0]) is type(fused.model.layers[0])
        assert other.model.layers[0]._fastgrpo_parts[2] is other.model.layers[0].self_attn.q_proj
        count_fused.clear()
        torch.testing.assert_close(packed_hidden_states(other, batch), want, rtol=0, atol=0)
        assert len(count_fused) == 2


def test_unsupported_layers_are_left_alone():
    sliding = _model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    n = FL.use_fused_layers(sliding)
    assert n == 0 and type(sliding.model.layers[0]).__name__ == "Qwen2DecoderLayer"
    gelu = _model("llama", hidden_act="gelu")
    assert FL.use_fused_layers(gelu) == 0
    mlp_bias = _model("llama", mlp_bias=True)
    assert FL.use_fused_layers(mlp_bias) == 0


def test_bad_segments_are_refused():
    fused = _model()
    FL.use_fused_layers(fused)
    batch = _batch(True)
    bad = batch.segment_prefix.clone()
    i = int(bad[:, 1].nonzero()[0])
    bad[i, 0] = batch.cu_seqlens[i]  # a "prefix" that starts at its own segment
    batch.segment_prefix = bad
    with pytest.raises(ValueError, match=r"segment_prefix\[\d+\].*before its segment"):
        packed_hidden_states(fused, batch)
    batch.segment_prefix = bad[:2]
    with pytest.raises(ValueError, match="segment_prefix: expected"):
        packed_hidden_states(fused, batch)


def test_non_finite_inputs_propagate_without_a_crash():
    """A NaN weight gives non-finite hidden states (the trainer skips such a step), not a crash
    or a finite-looking result."""
    fused = _model()
    FL.use_fused_layers(fused)
    with torch.no_grad():
        fused.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    h = packed_hidden_states(fused, _batch(False))
    assert not torch.isfinite(h).all()


def test_double_backward_is_refused():
    fused = _model()
    FL.use_fused_layers(fused)
    h = packed_hidden_states(fused, _batch(False))
    (g,) = torch.autograd.grad(h.square().sum(), fused.model.embed_tokens.weight, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        g.sum().backward()


def test_frozen_weights_get_no_gradient_and_inputs_do():
    fused = _model()
    FL.use_fused_layers(fused)
    for n, p in fused.named_parameters():
        p.requires_grad_("mlp" in n)
    h = packed_hidden_states(fused, _batch(False))
    h.sum().backward()
    for n, p in fused.named_parameters():
        assert (p.grad is not None) == ("mlp" in n), n


def test_two_threads_equal_one(count_fused):
    """The C++ loops split rows and segments over threads: results as close to float64 as one
    thread's (the GEMMs may split their sums over threads too, so not bit-equal on every CPU)."""
    fused = _model("qwen2", 4, 2, 16)
    exact = _model("qwen2", 4, 2, 16).double()
    FL.use_fused_layers(fused)
    batch = _batch(True)
    coef = torch.randn(batch.targets.numel(), generator=torch.Generator().manual_seed(3))
    n = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(_tensors(_run(fused, batch, coef)))
    finally:
        torch.set_num_threads(n)
    assert len(count_fused) == 8
    _check("two threads", fused, batch, outs[1], outs[0], _tensors(_run(exact, batch, coef)))


def test_replaced_weights_of_another_shape_take_the_model_own_forward(count_fused):
    fused = _model()
    FL.use_fused_layers(fused)
    layer = fused.model.layers[0]
    layer.mlp.gate_proj = torch.nn.Linear(64, 96, bias=False)
    layer.mlp.up_proj = torch.nn.Linear(64, 96, bias=False)
    layer.mlp.down_proj = torch.nn.Linear(96, 64, bias=False)
    h = packed_hidden_states(fused, _batch(False))
    assert torch.isfinite(h).all() and len(count_fused) == 1  # layer 1 only


def test_an_empty_packed_row(count_fused):
    """No token at all: zero rows out, and its backward runs."""
    from fastgrpo.models.packed import enable_packed_attention

    fused = _model()
    FL.use_fused_layers(fused)
    enable_packed_attention(fused)
    x = torch.randn(1, 0, 64, requires_grad=True)
    cos = sin = torch.zeros(1, 0, 32)
    y = fused.model.layers[0](x, position_embeddings=(cos, sin), cu_seq_lens_q=torch.zeros(1, dtype=torch.int64))
    assert y.shape == (1, 0, 64) and count_fused == [0]
    y.sum().backward()
    assert x.grad.shape == (1, 0, 64)


class _LoraLinear(torch.nn.Module):
    """A PEFT-style wrapper: exposes its base layer's `weight` (and bias), adds a low-rank term."""

    def __init__(self, base, r=2):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(r, base.in_features) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, r) * 0.1)

    @property
    def weight(self):
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


@pytest.mark.parametrize("change", ["lora", "act", "backward_hook", "module_dropout"])
def test_parts_changed_after_the_swap_take_the_model_own_forward(count_fused, change):
    """A part replaced or hooked after the swap (whose forward or hooks the fused path would skip),
    or attention dropout switched on in the attention module alone: the model's own layer runs,
    with the model's own results."""
    plain = _model()
    fused = copy.deepcopy(plain)
    FL.use_fused_layers(fused)
    seen = []
    for m in (plain, fused):
        layer = m.model.layers[0]
        torch.manual_seed(5)
        if change == "lora":
            layer.self_attn.q_proj = _LoraLinear(layer.self_attn.q_proj)
        elif change == "act":
            layer.mlp.act_fn = torch.nn.GELU()
        elif change == "backward_hook":
            layer.mlp.up_proj.register_full_backward_hook(lambda *a: seen.append(1))
        else:
            m.eval()
            layer.self_attn.train()
            layer.self_attn.attention_dropout = 0.5
    batch = _batch(False)
    torch.manual_seed(0)
    got = packed_hidden_states(fused, batch)
    got.sum().backward()
    assert len(count_fused) == 1  # layer 1 only
    torch.manual_seed(0)
    want = packed_hidden_states(plain, batch)
    depth = train_depth(plain.config, _keys(batch), batch.input_ids.numel())
    if change == "module_dropout":
        # both draw the same dropout masks (same seed, same calls), which a float64 copy would
        # not: each is within the float32 bound of the exact result (rms ≤ 2·tol, see
        # model_oracle), so the two are within 3·tol of each other
        check_fp32(change, got, None, want, 3 * fp32_tol(depth, want))
    else:  # the model's own layer 0, and layer 1 fused: next to the float64 model
        exact = copy.deepcopy(plain).double()
        with torch.no_grad():
            truth = packed_hidden_states(exact, batch)
        _check(change, plain, batch, {"hidden": got.detach()}, {"hidden": want.detach()}, {"hidden": truth})
    if change == "backward_hook":
        assert seen == [1]


def test_a_broadcast_final_norm_weight_takes_the_model_own_norm():
    plain = _model()
    fused = copy.deepcopy(plain)
    FL.use_fused_layers(fused)
    for m in (plain, fused):
        m.model.norm.weight = torch.nn.Parameter(torch.full((1,), 1.5))
    exact = copy.deepcopy(plain).double()
    batch = _batch(False)
    got, want, truth = (_hidden_and_grads(m, batch) for m in (fused, plain, exact))
    _check("broadcast norm weight", plain, batch, got, want, truth)


def test_packed_forward_under_inference_mode(count_fused):
    """Inference tensors carry no version counter: the segment caches must not need one."""
    fused = _model()
    FL.use_fused_layers(fused)
    batch = _batch(True)
    want = packed_hidden_states(fused, batch)
    with torch.inference_mode():
        got = packed_hidden_states(fused, batch)
        again = packed_hidden_states(fused, batch)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    assert len(count_fused) == 6
    exact = copy.deepcopy(fused).double()
    FL.restore_layers(fused)
    with torch.inference_mode():  # the model's own layers (the varlen plan cache) too
        own = packed_hidden_states(fused, batch)
    FL.restore_layers(exact)
    with torch.no_grad():
        truth = packed_hidden_states(exact, batch)
    _check("inference mode", fused, batch, {"hidden": want}, {"hidden": own}, {"hidden": truth})


def test_tiled_transpose_any_shape():
    ops = FL.ops_module()
    for shape in ((1, 1), (17, 33), (0, 5), (5, 0), (16, 16), (1923, 70)):
        x = torch.randn(shape)
        assert torch.equal(ops.transpose(x), x.t().contiguous()), shape


def test_qwen3_head_norms_are_fused_and_a_replaced_one_is_not(count_fused):
    """Qwen3's q_norm / k_norm are part of the fused layer (their weights get gradients); one
    replaced after the swap sends the layer back to the model's own forward."""
    plain = _model("qwen3")
    fused = copy.deepcopy(plain)
    assert FL.use_fused_layers(fused) == 2
    batch = _batch(True)
    h = packed_hidden_states(fused, batch)
    h.square().mean().backward()
    assert len(count_fused) == 2
    assert fused.model.layers[0].self_attn.q_norm.weight.grad.abs().sum() > 0
    assert fused.model.layers[0].self_attn.k_norm.weight.grad.abs().sum() > 0
    count_fused.clear()
    for m in (plain, fused):
        m.model.layers[1].self_attn.k_norm = torch.nn.LayerNorm(m.model.layers[1].self_attn.head_dim)
    exact = copy.deepcopy(plain).double()
    got, want, truth = (_hidden_and_grads(m, batch) for m in (fused, plain, exact))
    _check("replaced k_norm", plain, batch, got, want, truth)
    assert len(count_fused) == 1


def test_a_k_norm_eps_changed_after_the_swap_takes_the_model_own_forward(count_fused):
    """The kernel normalises q and k heads with one eps (checked equal at the swap): a k_norm eps
    changed later sends the layer to the model's own forward."""
    plain = _model("qwen3")
    fused = copy.deepcopy(plain)
    FL.use_fused_layers(fused)
    for m in (plain, fused):
        m.model.layers[0].self_attn.k_norm.variance_epsilon = 0.5
    exact = copy.deepcopy(plain).double()
    batch = _batch(False)
    got, want, truth = (_hidden_and_grads(m, batch) for m in (fused, plain, exact))
    _check("changed k_norm eps", plain, batch, got, want, truth)
    assert len(count_fused) == 1


def test_the_demo_builder_makes_qwen3_models_the_fused_layers_take():
    from fastgrpo.models.tiny import build_tiny_model

    model, _ = build_tiny_model("qwen3")
    assert type(model).__name__ == "Qwen3ForCausalLM" and FL.use_fused_layers(model) == 2
