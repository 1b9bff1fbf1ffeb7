"""The built-in engine's sampler: csrc/jit/sampler.cpp's `sample_step` (native) and
`decoders.pick` (Python) draw from softmax(logits / T) (chi-square on many fixed-seed draws),
return float64-exact log-probs, never draw a masked token, check stop tokens, refuse non-finite
logits, and the engine takes `pick` when the native module is switched off.

Draws and log-probs are held to float64 up to what float32 may differ by on any CPU
(rollout_oracle.check_draws / check_sampler_logprobs): a draw may differ from float64's only
where its uniform lies within rounding of a CDF boundary."""
import pytest
import torch

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import SamplingConfig
from fastgrpo.native import decode_step as _native
from fastgrpo.rollout.decoders import pick, uniforms
from fastgrpo.rollout.torch_engine import TorchEngine, process_logits
from rollout_oracle import check_draws, check_engine, check_sampler_logprobs, float64_copy

LOGITS = torch.tensor([2.0, 1.0, 0.5, float("-inf"), 0.0, -3.0, 1.5])
# chi-square critical value at p = 1e-4 for 5 degrees of freedom (6 drawable tokens). On any CPU
# the draws are the float64 inverse CDF's but for uniforms within ~2e-6 of a boundary
# (check_draws): at most 2 of the 40000 here, each moving the statistic (1.6 to 6.7 at these
# seeds) by < 1.7, so it stays far below the critical value wherever they fall.
CHI2_CRIT_DF5 = 25.74
# float32 partial sums of the native sampler: blocks of 16 tokens (one AVX-512 vector; float64
# across blocks), whatever the CPU's vector width; `pick` sums the vocabulary in float32 (depth V)
NATIVE_DEPTH = 16


@pytest.fixture(scope="module")
def native():
    mod = _native.decode_step_module()
    assert mod is not None  # the CI machine has a compiler: a silent fallback would leave it untested
    return mod


def _sample(native, z, temperature, u, stop=(), alive=None):
    """sample_step on every row of z at step 0 (one row per original row)."""
    b = z.shape[0]
    alive = torch.ones(b, dtype=torch.bool) if alive is None else alive
    out = {"nxt": torch.empty(b, dtype=torch.long), "alive": alive,
           "tok": torch.full((b, 2), -1, dtype=torch.long), "lp": torch.zeros((b, 2)),
           "length": torch.full((b,), 2, dtype=torch.long), "stopped": torch.zeros(b, dtype=torch.bool)}
    u2 = torch.empty((0, 0)) if u is None else torch.stack([u, u], 1).contiguous()
    out["n_done"] = native.sample_step(z.contiguous(), temperature, u2, 0, torch.arange(b),
                                       torch.tensor(stop, dtype=torch.long), out["nxt"], out["alive"], out["tok"],
                                       out["lp"], out["length"], out["stopped"])
    return out


def _chi2(tok, probs):
    n = tok.numel()
    counts = torch.bincount(tok, minlength=probs.numel()).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    want = probs[keep].double() * n
    return float(((counts[keep] - want) ** 2 / want).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_native_draws_follow_the_tempered_softmax(native, temperature):
    n = 40000
    z = LOGITS.expand(n, -1)
    u = torch.rand(n, generator=torch.Generator().manual_seed(11))
    out = _sample(native, z, temperature, u)
    check_draws("native", out["nxt"], z, temperature, u, NATIVE_DEPTH)
    want = torch.softmax(LOGITS.double() / temperature, -1)
    assert _chi2(out["nxt"], want) < CHI2_CRIT_DF5
    # the check has power: the untempered distribution is rejected by the same draws
    if temperature != 1.0:
        assert _chi2(out["nxt"], torch.softmax(LOGITS.double(), -1)) > 10 * CHI2_CRIT_DF5
    check_sampler_logprobs("native", out["lp"][:, 0], out["nxt"], z, temperature, NATIVE_DEPTH)
    assert torch.equal(out["tok"][:, 0], out["nxt"]) and (out["tok"][:, 1] == -1).all()


def test_python_pick_follows_the_truncated_distribution():
    n = 40000
    z = LOGITS.expand(n, -1).contiguous()
    u = torch.rand(n, generator=torch.Generator().manual_seed(12))
    tok, lp = pick(z, 0.7, 4, 1.0, u, process_logits)
    top4 = LOGITS >= LOGITS.topk(4).values[-1]  # the logits are distinct: no tie at the 4th
    want = torch.softmax((LOGITS.double() / 0.7).masked_fill(~top4, float("-inf")), -1)
    assert (want > 0).sum() == 4
    check_draws("pick", tok, z.masked_fill(~top4, float("-inf")), 0.7, u, z.shape[-1])
    assert _chi2(tok, want) < 21.11  # p = 1e-4, 3 degrees of freedom
    check_sampler_logprobs("pick", lp, tok, z, 0.7, z.shape[-1], top_k_mask=top4.expand_as(z))


@pytest.mark.parametrize("vocab", [7, 104, 5000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_native_tokens_and_logprobs_equal_float64(native, vocab, temperature):
    """Random logits of magnitude ~5 over small and multi-block vocabularies: the same token as a
    float64 inverse CDF with the same uniforms, and the float64 log-softmax of it."""
    g = torch.Generator().manual_seed(vocab)
    z = torch.randn((256, vocab), generator=g) * 5
    z[:, ::5] = float("-inf")  # masked tokens among the kept ones
    u = torch.rand(256, generator=g)
    out = _sample(native, z, temperature, u)
    check_draws("native", out["nxt"], z, temperature, u, NATIVE_DEPTH)
    assert (out["nxt"] % 5 != 0).all()
    check_sampler_logprobs("native", out["lp"][:, 0], out["nxt"], z, temperature, NATIVE_DEPTH)
    py_tok, py_lp = pick(z, temperature, 0, 1.0, u, process_logits)
    check_draws("pick", py_tok, z, temperature, u, vocab)
    check_sampler_logprobs("pick", py_lp, py_tok, z, temperature, vocab)


def test_extreme_uniforms_never_draw_a_masked_token(native):
    """u = 0 and the largest float32 below 1, with masked tokens first and last: the first and
    last drawable tokens, never a -inf one (in both samplers)."""
    z = torch.full((4, 300), float("-inf"))
    z[:, 70] = 1.0
    z[:, 200] = 3.0
    u = torch.tensor([0.0, 1.0 - 2 ** -24, 0.5, 1e-30])
    want = torch.tensor([70, 200, 200, 70])
    for temperature in (1.0, 0.3):
        assert torch.equal(_sample(native, z, temperature, u)["nxt"], want)
        assert torch.equal(pick(z, temperature, 0, 1.0, u, process_logits)[0], want)


def test_greedy_is_the_first_maximum_with_untempered_logprobs(native):
    z = torch.tensor([[0.5, 2.0, 2.0, -1.0], [float("-inf"), -3.0, -2.0, -2.5]])
    out = _sample(native, z, 0.0, None)
    assert out["nxt"].tolist() == [1, 2] == z.argmax(-1).tolist()  # exact ties: equal floats on any CPU
    check_sampler_logprobs("greedy", out["lp"][:, 0], out["nxt"], z, 0.0, NATIVE_DEPTH)


def test_stop_tokens_finish_live_rows_once(native):
    z = torch.full((4, 10), -10.0)
    z[torch.arange(4), torch.tensor([3, 5, 3, 8])] = 10.0  # greedy picks 3, 5, 3, 8
    alive = torch.tensor([True, True, False, True])      # row 2 had finished before
    out = _sample(native, z, 0.0, None, stop=(3, 8), alive=alive)
    assert out["n_done"] == 2
    assert out["alive"].tolist() == [False, True, False, False]
    assert out["stopped"].tolist() == [True, False, False, True]
    assert out["length"].tolist() == [1, 2, 2, 1]
    assert out["tok"][:, 0].tolist() == [3, 5, 3, 8]      # a finished row still writes (past its length)


def test_rows_map_to_their_original_slots(native):
    """After compaction batch row i is original row rows[i]: its token, log-prob and uniform."""
    z = torch.randn((3, 50), generator=torch.Generator().manual_seed(1))
    u = torch.tensor([[0.1, 0.9], [0.5, 0.5], [0.2, 0.99], [0.7, 0.3]])
    rows = torch.tensor([3, 0, 2])
    tok, lp = torch.full((4, 2), -1, dtype=torch.long), torch.zeros(4, 2)
    nxt = torch.empty(3, dtype=torch.long)
    native.sample_step(z, 1.0, u, 1, rows, torch.tensor([], dtype=torch.long), nxt, torch.ones(3, dtype=torch.bool),
                       tok, lp, torch.full((4,), 2, dtype=torch.long), torch.zeros(4, dtype=torch.bool))
    check_draws("rows", nxt, z, 1.0, u[rows, 1], NATIVE_DEPTH)
    assert torch.equal(tok[rows, 1], nxt) and (tok[1] == -1).all() and (tok[:, 0] == -1).all()


@pytest.mark.parametrize("bad", ["nan", "inf", "masked"])
def test_non_finite_logits_are_an_error(native, bad):
    z = torch.randn(3, 20)
    if bad == "nan":
        z[1, 4] = float("nan")
    elif bad == "inf":
        z[1, 4] = float("inf")
    else:
        z[1] = float("-inf")
    u = torch.full((3,), 0.5)
    for temperature in (0.0, 1.0, 0.8):
        with pytest.raises(ValueError, match="row 1 at step 0 are not finite"):
            _sample(native, z, temperature, u)
        with pytest.raises(ValueError, match="row 1 at step 0 are not finite"):
            pick(z, temperature, 0, 1.0, u, process_logits)


def test_bad_layouts_are_refused(native):
    z = torch.randn(3, 20)
    with pytest.raises(RuntimeError, match="logits must be contiguous float32"):
        _sample(native, z.double(), 1.0, torch.rand(3))
    with pytest.raises(RuntimeError, match="uniforms must be contiguous float32"):
        native.sample_step(z, 1.0, torch.rand(3, 1), 1, torch.arange(3), torch.tensor([], dtype=torch.long),
                           torch.empty(3, dtype=torch.long), torch.ones(3, dtype=torch.bool),
                           torch.zeros((3, 2), dtype=torch.long), torch.zeros(3, 2),
                           torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="outside the batch"):
        native.sample_step(z, 0.0, torch.empty(0, 0), 0, torch.tensor([0, 1, 7]), torch.tensor([], dtype=torch.long),
                           torch.empty(3, dtype=torch.long), torch.ones(3, dtype=torch.bool),
                           torch.zeros((3, 2), dtype=torch.long), torch.zeros(3, 2),
                           torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.bool))


def test_uniforms_follow_their_seed_not_the_batch():
    gens = lambda seeds: [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    a = uniforms(gens([4, None, 9]), 6, "cpu")
    b = uniforms(gens([9]), 6, "cpu")
    assert a.shape == (3, 6) and torch.equal(a[2], b[0])
    assert ((a >= 0) & (a < 1)).all()


def _tiny(seed=3):
    model, tok = build_tiny_model("qwen2", seed=seed, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=32, intermediate_size=96)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval(), tok


def test_engine_falls_back_to_pick_when_switched_off(monkeypatch):
    """FASTGRPO_NATIVE_DECODE=0: no native sampler (nor step); the rollouts are the same draws."""
    model, tok = _tiny()
    prompts = ["1+2=", "12*34-5=", "a"]
    sp = SamplingConfig(temperature=0.8, max_new_tokens=16, seed=2, stop_token_ids=(5,))
    eng = TorchEngine(model, tok)
    logits = torch.zeros(1, 4)
    assert eng._native_sampler(torch.device("cpu"), logits) is not None
    assert TorchEngine(model, tok, decoder="lean")._native_sampler(torch.device("cpu"), logits) is None
    assert eng._native_sampler(torch.device("cpu"), logits.double()) is None
    on = eng.generate(prompts, 3, sp)
    monkeypatch.setenv("FASTGRPO_NATIVE_DECODE", "0")
    assert eng._native_sampler(torch.device("cpu"), logits) is None
    off = eng.generate(prompts, 3, sp)
    # the same draws: each path's are the float64 model's for the seeds (up to a boundary tie)
    exact = float64_copy(model)
    check_engine("native", model, tok, prompts, on, sp, exact)
    check_engine("pick", model, tok, prompts, off, sp, exact)
    for ga, gb in zip(on, off):
        for a, b in zip(ga, gb):
            if a.token_ids == b.token_ids:
                assert a.finish_reason == b.finish_reason


@pytest.mark.parametrize("decoder", ["auto", "hf"])
def test_engine_reports_nan_logits(decoder):
    model, tok = _tiny()
    with torch.no_grad():
        model.lm_head.weight[5, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        TorchEngine(model, tok, decoder=decoder).generate(["1+2="], 2, SamplingConfig(max_new_tokens=4, seed=0))


@pytest.mark.parametrize("decoder", ["auto", "hf"])
@pytest.mark.parametrize("training", [True, False])
def test_the_module_mode_is_left_as_it_was(decoder, training):
    """The HF path runs the module in eval mode (no dropout in a rollout); both paths hand the
    trainer's module back in the mode they found it in."""
    model, tok = _tiny()
    model.train(training)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(m.training))
    out = TorchEngine(model, tok, decoder=decoder).generate(["1+2=", "a"], 2, SamplingConfig(max_new_tokens=3, seed=0))
    assert len(out) == 2 and model.training == training
    assert all(m.training == training for m in model.modules())
    if decoder == "hf":
        assert seen and not any(seen)


def test_a_temperature_that_underflows_float32_is_refused(native):
    """0 < T below float32's range would take the greedy branch with the τ = 1 log-prob: refused."""
    z = torch.randn(2, 7)
    with pytest.raises(ValueError, match="underflows float32"):
        _sample(native, z, 1e-46, torch.rand(2))
    out = _sample(native, z, 0.0, None)  # 0 is greedy, as documented
    assert torch.equal(out["nxt"], z.argmax(1))
