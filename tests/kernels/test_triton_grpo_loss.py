"""Triton GRPO loss (kernels/grpo_loss.py) vs the float64 oracle, under TRITON_INTERPRET=1 on CPU."""
import pytest
import torch

from fastgrpo import loss as api
from fastgrpo.kernels.triton import _common as tc
from fastgrpo.kernels.contract import LossConfig
from fastgrpo.kernels.triton.grpo_loss import grpo_loss_triton
from fastgrpo.kernels.triton.logprobs import _token_logprobs_fwd_kernel
from kernel_oracle import DEV, LOSS_CASES, check_loss, loss_kwargs, make_batch

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# (N, V, sequence lengths): V = 507 / 3000 are not multiples of any block (3000 spans two
# 2048-column blocks under the interpreter), a length-1 sequence, an empty one, N = 1.
SHAPES = [(1, 7, [1]), (7, 123, [3, 1, 0, 3]), (123, 507, [40, 30, 1, 52]), (45, 3000, [20, 10, 15])]


def run_case(dtype, cfg, uses, shape, seed=0, inplace=False):
    n, v, seqlens = shape
    return check_loss(grpo_loss_triton, make_batch(n, v, seqlens, seed=seed), dtype, cfg, uses, inplace=inplace)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
def test_every_option_vs_oracle(case, dtype):
    name, cfg, uses = case
    i = [c[0] for c in LOSS_CASES].index(name)
    run_case(dtype, cfg, uses, SHAPES[i % len(SHAPES)], seed=i)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{s[0]}-V{s[1]}" for s in SHAPES])
def test_odd_shapes_fp64_and_fp16(shape):
    cfg = LossConfig(beta=0.05, entropy_coef=0.01, eps_high=0.28, temperature=0.7)
    run_case(torch.float64, cfg, {"old_logp", "ref_logp", "weights"}, shape, seed=7)
    run_case(torch.float16, cfg, {"old_logp", "ref_logp", "weights"}, shape, seed=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inplace_backward_overwrites_logits_with_the_same_gradient(dtype):
    b = make_batch(37, 301, [20, 17], seed=3)
    cfg = LossConfig(beta=0.1, entropy_coef=0.01)
    kw = loss_kwargs(b, {"old_logp", "ref_logp"}, dtype)
    x = b["logits"].to(dtype)
    grads = {}
    for inplace in (False, True):
        leaf = x.clone().requires_grad_(True)
        buf = leaf * 1  # the logits buffer the backward may overwrite
        out = grpo_loss_triton(buf, b["targets"], b["advantages"].float(), config=cfg,
                               inplace_backward=inplace, **kw)
        out.loss.backward()
        grads[inplace] = (leaf.grad, buf.detach())
    assert torch.equal(grads[True][0], grads[False][0])
    assert torch.equal(grads[True][1], grads[True][0]), "in place: the logits buffer must hold the gradient"
    assert torch.equal(grads[False][1], x), "out of place: the logits must be left intact"
    leaf = x.clone().requires_grad_(True)  # a leaf is never overwritten, even when asked
    grpo_loss_triton(leaf, b["targets"], b["advantages"].float(), config=cfg, inplace_backward=True,
                     **kw).loss.backward()
    assert torch.equal(leaf.detach(), x) and torch.equal(leaf.grad, grads[False][0])
    run_case(dtype, cfg, {"old_logp", "ref_logp"}, (37, 301, [20, 17]), seed=3, inplace=True)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{s[0]}-V{s[1]}" for s in SHAPES])
def test_softcap_odd_shapes_fp64_fp16_and_in_place(shape):
    """The soft cap on every shape in fp64 (oracle-grade: the cap passes as an fp32 pair), fp16,
    and in place in bf16: the gradient written into the logits is w.r.t. the uncapped logits."""
    cfg = LossConfig(softcap=3.0, beta=0.05, entropy_coef=0.01, eps_high=0.28, temperature=0.7)
    uses = {"old_logp", "ref_logp", "weights"}
    run_case(torch.float64, cfg, uses, shape, seed=21)
    run_case(torch.float16, cfg, uses, shape, seed=22)
    run_case(torch.bfloat16, cfg, uses, shape, seed=23, inplace=True)


def test_strided_logits_row_stride_and_transposed_view():
    b = make_batch(29, 211, [29], seed=4)
    cfg = LossConfig(entropy_coef=0.02)
    kw = loss_kwargs(b, {"old_logp"}, torch.float32)
    x = b["logits"].float()
    ref_leaf = x.clone().requires_grad_(True)
    ref = grpo_loss_triton(ref_leaf, b["targets"], b["advantages"].float(), config=cfg, **kw)
    ref.loss.backward()
    wide = torch.zeros(29, 250, device=DEV)
    wide[:, :211] = x
    views = {"row-stride": wide[:, :211], "transposed": x.t().contiguous().t()}
    b["targets"] = torch.stack([b["targets"], b["targets"]], 1)[:, 0]  # a strided targets view too
    assert b["targets"].stride(0) == 2
    for name, view in views.items():
        leaf = view.clone() if name == "transposed" else wide.clone()
        leaf.requires_grad_(True)
        src = leaf if name == "transposed" else leaf[:, :211]
        assert src.stride() == view.stride()
        for inplace in (False, True):
            if leaf.grad is not None:
                leaf.grad = None
            out = grpo_loss_triton(src * 1 if inplace else src, b["targets"], b["advantages"].float(),
                                   config=cfg, inplace_backward=inplace, **kw)
            out.loss.backward()
            grad = leaf.grad if name == "transposed" else leaf.grad[:, :211]
            assert torch.equal(out.logp, ref.logp), name
            assert torch.allclose(grad, ref_leaf.grad, atol=1e-7, rtol=1e-6), (name, inplace)
            if name == "row-stride":
                assert torch.count_nonzero(leaf.grad[:, 211:]) == 0


def test_more_rows_than_one_grid_dimension_allows():
    # 70 000 rows > 65 535, the limit of grid axes 1/2 (and of Liger's kernels at one row per program).
    b = make_batch(70_001, 5, [30_000, 40_001], seed=5)
    b["mask"][-1] = 1.0
    cfg = LossConfig(loss_agg="seq-mean-token-mean", entropy_coef=0.01)
    out = check_loss(grpo_loss_triton, b, torch.float32, cfg, uses=set())
    assert torch.count_nonzero(out["d_logits"][-1]) > 0, "the last row must be reached"


def test_fully_masked_batch_gives_zero_gradient_and_loss():
    b = make_batch(19, 77, [10, 9], seed=6)
    leaf = b["logits"].float().requires_grad_(True)
    out = api.grpo_loss(leaf, b["targets"], b["advantages"].float(), mask=torch.zeros(19, device=DEV),
                        old_logp=b["old_logp"].float(), config=LossConfig(beta=0.1),
                        ref_logp=torch.full((19,), float("-inf"), device=DEV), impl="triton")
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0
    assert torch.count_nonzero(leaf.grad) == 0


def test_nonfinite_logits_raise_like_the_torch_path_and_minus_inf_is_probability_zero():
    b = make_batch(6, 40, [6], seed=9)
    x = b["logits"].float()
    errors = {}
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[4, 11] = bad
        for impl in ("torch", "triton"):
            with pytest.raises(ValueError, match="row 4 contains NaN or Inf") as e:
                api.grpo_loss(y, b["targets"], b["advantages"].float(), impl=impl)
            errors[impl] = str(e.value)
        assert errors["torch"] == errors["triton"]
    # −inf marks an impossible token: a valid input, p = 0, finite loss, entropy and gradient.
    y = x.clone()
    y[2, 5] = float("-inf")
    b["targets"][2] = 6
    outs = {}
    for impl, dt in (("reference", torch.float64), ("triton", torch.float32)):
        leaf = y.to(dt).clone().requires_grad_(True)
        out = api.grpo_loss(leaf, b["targets"], b["advantages"].to(dt), impl=impl, old_logp=b["old_logp"].to(dt))
        out.loss.backward()
        outs[impl] = (out, leaf.grad)
    lp_r = torch.log_softmax(y.double(), -1)
    ent_r = -(lp_r.exp() * lp_r.nan_to_num(neginf=0.0)).sum(-1)
    kern = outs["triton"][0]
    assert torch.allclose(kern.logp.double(), outs["reference"][0].logp, atol=1e-6)
    assert torch.allclose(api.token_logprobs(y, b["targets"], return_entropy=True, impl="triton")[1].double(),
                          ent_r, atol=1e-6)
    assert torch.allclose(outs["triton"][1].double(), outs["reference"][1], atol=1e-7)
    assert float(outs["triton"][1][2, 5]) == 0.0


def test_row_starting_with_a_fully_masked_vocabulary_block():
    # The first 2100 columns (more than one 2048-column block) at −inf: the online max starts at −inf.
    b = make_batch(5, 3000, [5], seed=12)
    x = b["logits"].float()
    x[1, :2100] = float("-inf")
    b["targets"][1] = 2500
    outs = {}
    for impl, dt in (("reference", torch.float64), ("triton", torch.float32)):
        leaf = x.to(dt).clone().requires_grad_(True)
        out = api.grpo_loss(leaf, b["targets"], b["advantages"].to(dt), old_logp=b["old_logp"].to(dt), impl=impl)
        out.loss.backward()
        outs[impl] = (out.logp, leaf.grad)
    assert torch.allclose(outs["triton"][0].double(), outs["reference"][0], atol=1e-5)
    assert torch.allclose(outs["triton"][1].double(), outs["reference"][1], atol=1e-7)
    lp_r = torch.log_softmax(x[1].double(), -1)
    ent = api.token_logprobs(x, b["targets"], return_entropy=True, impl="triton")[1][1]
    assert abs(float(ent) + float((lp_r.exp() * lp_r.nan_to_num(neginf=0.0)).sum())) < 1e-5


def test_facade_auto_picks_triton_only_on_cuda_and_triton_matches_torch_path():
    b = make_batch(33, 129, [11, 22], seed=11)
    cfg = LossConfig(beta=0.02, ratio_level="sequence", entropy_coef=0.01)
    kw = loss_kwargs(b, {"old_logp", "ref_logp", "weights"}, torch.float32)
    res = {}
    for impl in ("auto", "torch", "triton"):
        leaf = b["logits"].float().requires_grad_(True)
        out = api.grpo_loss(leaf, b["targets"], b["advantages"].float(), config=cfg, impl=impl, **kw)
        out.loss.backward()
        res[impl] = (out.loss, leaf.grad)
    auto_is = "triton" if DEV.type == "cuda" else "torch"  # CPU tensors: auto → the torch path
    assert torch.equal(res["auto"][1], res[auto_is][1])
    assert torch.allclose(res["triton"][0], res["torch"][0], atol=1e-6)
    assert torch.allclose(res["triton"][1], res["torch"][1], atol=1e-7)


def test_runtime_scalars_are_not_constexpr_and_gpu_pruning_keeps_valid_configs(monkeypatch):
    # A new temperature must not recompile: inv_temp has to be a runtime argument.
    import inspect

    from fastgrpo.kernels.triton.grpo_loss import _grpo_loss_bwd_kernel

    from fastgrpo.kernels.triton.fused_linear import _cce_bwd_kernel, _cce_fwd_kernel

    runtime = {"inv_temp", "inv_temp_lo", "softcap", "softcap_lo"}  # a new τ or soft cap must not recompile
    for kernel in (_token_logprobs_fwd_kernel, _grpo_loss_bwd_kernel, _cce_fwd_kernel, _cce_bwd_kernel):
        params = inspect.signature(kernel.fn).parameters  # JIT/InterpretedFunction → def
        constexpr = {k for k, p in params.items() if "constexpr" in str(p.annotation)}
        want = runtime if "cce" not in kernel.fn.__name__ else {"inv_temp", "softcap"}
        assert want <= set(params) and not want & constexpr, kernel.fn.__name__
        assert {"BLOCK_N", "BLOCK_V", "HAS_SOFTCAP"} <= constexpr
    # The GPU path of the config pruning (not reached under the interpreter).
    from fastgrpo.kernels.triton import _tune

    for configs in (_tune.SM90, _tune.FALLBACK):
        for n_cols in (5, 300, 151_936):
            for layout in "atu":
                kept = _tune.candidates(configs, n_cols, layout)
                # unaligned rows prefer a padded block over a tile that spills
                assert kept and (layout == "u" or all(c.block_v <= max(128, 2 ** (n_cols - 1).bit_length())
                                                      for c in kept))
                assert set(kept) <= set(configs)
                if layout == "u" and len(kept) > 1:
                    assert all(c.elems_per_thread() <= _tune.UNALIGNED_ELEMS_PER_THREAD for c in kept)
    assert all(c.num_stages == 1 for c in _tune.SM90 + _tune.FALLBACK)
    cfg = tc.interp_config(70_001, 5)
    assert cfg.block_v == 8 and cfg.block_n * cfg.block_v <= tc._INTERP_TILE
