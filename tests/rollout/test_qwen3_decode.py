"""Qwen3 in the built-in engine's lean decoder (fastgrpo/rollout/decoders.py LeanStepper and its
native step, csrc/jit/decode_step.cpp): q_norm / k_norm (a per-head RMSNorm before RoPE) in both
steps, against a float64 HF step, the HF forward (native prefill), HF `generate` (greedy) and a
packed forward (sampled log-probs), each next to float64 (rollout_oracle: bounds that hold on any
x86 CPU); a sliding-window Qwen3 stays on the HF module."""
import pytest
import torch

from fastgrpo.models.tiny import build_char_tokenizer
from fastgrpo.models.packed import packed_logits, packed_logprobs
from fastgrpo.packing.layout import build_packed_batches
from fastgrpo.rollout import SamplingConfig
from fastgrpo.rollout.decoders import HFStepper, LeanStepper
from fastgrpo.rollout.torch_engine import TorchEngine
from rollout_oracle import U, check_engine, check_fp32, check_greedy_pair, decode_depth, float64_copy, fp32_tol

PROMPTS = ["1+2=", "12*34-5=", "a", "(7+8)*9="]
# (heads, kv heads, head dim, attention_bias): GQA 2:1 and 4:2, q/k/v/o biases once
SHAPES = [(2, 1, 32, False), (4, 2, 16, True)]


# one thread: the engine's choice for steps this small, and the native step's condition
pytestmark = pytest.mark.usefixtures("one_thread")


def _qwen3(heads=2, kv=1, head_dim=32, bias=False, seed=0, **over):
    from transformers import AutoModelForCausalLM, Qwen3Config

    tok = build_char_tokenizer()
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=head_dim, intermediate_size=96, attention_bias=bias,
                      tie_word_embeddings=True, max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
                      bos_token_id=2, rms_norm_eps=1e-6, rope_theta=10000.0, **over)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                # far from the init's ones and different per dim: a skipped or misapplied head
                # norm changes the logits by O(1) (test_the_head_norms_matter)
                p.copy_(torch.rand(p.shape, generator=g) * 1.5 + 0.25)
            else:  # off the flat random init: varied, prompt-dependent logits
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval(), tok


def _prompts(B=6, W=7):
    ids = torch.randint(3, 40, (B, W), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, W, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[3, :1] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _prefill(model, ids, mask, pos):
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)


def _keys(stepper, i, width):
    """Layer i's cached keys [B, Hkv, width, D] (the native step keeps them transposed)."""
    k = stepper.k[i].transpose(2, 3) if stepper.native is not None else stepper.k[i]
    return k[:, :, :width]


@pytest.mark.parametrize("heads,kv,head_dim,bias", SHAPES)
def test_lean_steps_equal_a_float64_hf_step(heads, kv, head_dim, bias):
    """The native and the Python lean step (float32) against the HF module stepping in float64,
    next to the HF module stepping in float32: logits and cached keys / values step after step
    (left padding; rows dropped midway), within rollout_oracle's float32 bound at every step."""
    model, _ = _qwen3(heads, kv, head_dim, bias)
    assert LeanStepper.supports(model)
    exact = float64_copy(model)
    ids, mask, pos = _prompts()
    W = ids.shape[1]
    depth = decode_depth(model.config, W + 10)
    with torch.inference_mode():
        res = _prefill(model, ids, mask, pos)
        nat = LeanStepper(model, res.past_key_values, mask, 20, native=True)
        res = _prefill(model, ids, mask, pos)
        py = LeanStepper(model, res.past_key_values, mask, 20, native=False)
        assert nat.native is not None and py.native is None
        hf = HFStepper(model, _prefill(model, ids, mask, pos).past_key_values, mask.clone())
        # (HFStepper hands back float32 logits: the float64 step's rounded once, 1/2 ulp ≪ tol)
        ref = HFStepper(exact, _prefill(exact, ids, mask, pos).past_key_values, mask.clone())
        nxt, gen = pos[:, -1] + 1, torch.Generator().manual_seed(2)
        for t in range(10):
            tok = torch.randint(3, 40, (len(nxt),), generator=gen)
            a, b, h, r = nat.step(tok, nxt, t), py.step(tok, nxt, t), hf.step(tok, nxt, t), ref.step(tok, nxt, t)
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == r.shape
            for name, got in (("native", a), ("python", b)):
                check_fp32(f"step {t} {name} logits", got, h, r, fp32_tol(depth, r))
            n = W + t + 1
            real = torch.cat([mask, mask.new_ones((mask.shape[0], t + 1))], 1).bool()  # pads: unwritten by HF
            for i in range(len(model.model.layers)):
                caches = {"K": (ref.cache.layers[i].keys, hf.cache.layers[i].keys),
                          "V": (ref.cache.layers[i].values, hf.cache.layers[i].values)}
                for what, (c_ref, c_hf) in caches.items():
                    truth = c_ref[:, :, :n].permute(0, 2, 1, 3)[real]
                    want = c_hf[:, :, :n].permute(0, 2, 1, 3)[real]
                    for s in (nat, py):
                        c = _keys(s, i, n) if what == "K" else s.v[i][:, :, :n]
                        check_fp32(f"step {t} layer {i} {what} cache ({'native' if s.native else 'python'})",
                                   c.permute(0, 2, 1, 3)[real], want, truth, fp32_tol(depth, truth))
            nxt = nxt + 1
            if t == 4:  # rows finish: all four drop them
                keep = torch.tensor([0, 2, 3, 5])
                nat.select(keep), py.select(keep), hf.select(keep), ref.select(keep)
                nxt, mask = nxt[keep], mask[keep]


def test_the_head_norms_matter():
    """At these weights a step without q_norm / k_norm is far off: the comparisons above would
    catch a norm skipped (or applied to v, or after RoPE) in either step."""
    model, _ = _qwen3()
    ids, mask, pos = _prompts()
    tok = torch.randint(3, 40, (6,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        out = {}
        for native in (True, False):
            for drop in (False, True):
                s = LeanStepper(model, _prefill(model, ids, mask, pos).past_key_values, mask, 4, native=native)
                if drop and native:
                    s._flat = [torch.empty(0) if j % 12 in (10, 11) else t for j, t in enumerate(s._flat)]
                elif drop:
                    s.layers = [layer[:12] + (None,) for layer in s.layers]
                out[native, drop] = s.step(tok, pos[:, -1] + 1, 0)
    for native in (True, False):
        assert (out[native, True] - out[native, False]).abs().max() > 0.1


def test_head_norm_weights_of_the_wrong_size_are_refused():
    """The native loops read D floats of each head norm weight unchecked: a wrong size is an
    error before the step, not a stray read."""
    model, _ = _qwen3()
    ids, mask, pos = _prompts()
    with torch.inference_mode():
        s = LeanStepper(model, _prefill(model, ids, mask, pos).past_key_values, mask, 4)
        assert s.native is not None
        s._flat[10] = s._flat[10][:8]
        with pytest.raises(RuntimeError, match="q_norm / k_norm weights of 8 / 32 for head dim 32"):
            s.step(ids[:, -1], pos[:, -1] + 1, 0)


@pytest.mark.parametrize("heads,kv,head_dim,bias", SHAPES)
def test_native_prefill_equals_the_hf_forward(heads, kv, head_dim, bias):
    """The native prefill and the HF forward (float32) next to the float64 HF forward: last
    logits and the cache on the real positions."""
    model, _ = _qwen3(heads, kv, head_dim, bias, seed=1)
    exact = float64_copy(model)
    B, W = 5, 9
    ids = torch.randint(3, 40, (B, W), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(B, W, dtype=torch.long)
    mask[0, :6] = 0
    mask[2, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    depth = decode_depth(model.config, W)
    with torch.inference_mode():
        nat, logits = LeanStepper.native_prefill(model, ids, mask, 6)
        res = _prefill(model, ids, mask, pos)
        res64 = _prefill(exact, ids, mask, pos)
        truth = res64.logits[:, -1]
        check_fp32("prefill logits", logits, res.logits[:, -1].float(), truth, fp32_tol(depth, truth))
        real = mask.bool()
        for i in range(len(model.model.layers)):
            for what, got in (("K", _keys(nat, i, W)), ("V", nat.v[i][:, :, :W])):
                layer, layer64 = res.past_key_values.layers[i], res64.past_key_values.layers[i]
                want, truth = (layer.keys, layer64.keys) if what == "K" else (layer.values, layer64.values)
                truth = truth.permute(0, 2, 1, 3)[real]
                check_fp32(f"layer {i} {what} cache", got.permute(0, 2, 1, 3)[real], want.permute(0, 2, 1, 3)[real],
                           truth, fp32_tol(depth, truth))


def _hf_greedy(model, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("decoder", ["auto", "lean"])
@pytest.mark.parametrize("heads,kv,head_dim,bias", SHAPES)
def test_greedy_equals_hf_generate(decoder, heads, kv, head_dim, bias):
    """Greedy tokens equal HF generate's, up to a tie float64 cannot tell apart within float32
    rounding (rollout_oracle.check_greedy_pair); every engine token is float64's argmax up to it."""
    model, tok = _qwen3(heads, kv, head_dim, bias, seed=3)
    exact = float64_copy(model)
    eng = TorchEngine(model, tok, decoder=decoder)
    eng.eos_ids = set()  # full-length sequences, as HF's with eos_token_id=None
    sp = SamplingConfig(temperature=0, max_new_tokens=12)
    out = eng.generate(PROMPTS, 1, sp)
    check_engine(decoder, model, tok, PROMPTS, out, sp, exact)
    for p, grp in zip(PROMPTS, out):
        ids = tok(p, add_special_tokens=False)["input_ids"]
        check_greedy_pair(p, exact, ids, grp[0].token_ids, _hf_greedy(model, tok, p, 12))


@pytest.mark.parametrize("heads,kv,head_dim,bias", SHAPES)
def test_sampled_logprobs_equal_a_packed_forward(heads, kv, head_dim, bias):
    """Native prefill, native steps and native sampler: the log-prob reported for each sampled
    token equals the trainer's packed forward over prompt ‖ completion, both next to the float64
    packed forward; each token is the float64 model's draw for its uniform (check_engine)."""
    model, tok = _qwen3(heads, kv, head_dim, bias, seed=5)
    exact = float64_copy(model)
    sp = SamplingConfig(temperature=0.8, max_new_tokens=16, seed=1)
    out = TorchEngine(model, tok).generate(PROMPTS, 3, sp)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS for _ in range(3)]
    comps = [c for grp in out for c in grp]
    assert all(c.token_ids for c in comps) and len({tuple(c.token_ids) for c in out[1]}) > 1
    check_engine("engine", model, tok, PROMPTS, out, sp, exact)
    batch = build_packed_batches(prompts, [c.token_ids for c in comps], [0.0] * len(comps), 10 ** 6,
                                 old_logp=[c.logprobs for c in comps])[0]
    with torch.no_grad():
        ref = packed_logprobs(model, batch, temperature=0.8)
        z64 = packed_logits(exact, batch)
    truth = (z64 / 0.8).log_softmax(-1).gather(-1, batch.targets[:, None])[:, 0]
    # a log-prob z_y/τ − lse(z/τ) moves by at most 2·max|dz|/τ, plus the sum over the vocabulary
    depth = decode_depth(model.config, max(len(p) + len(c.token_ids) for p, c in zip(prompts, comps)))
    tol = 2 * fp32_tol(depth, z64) / 0.8 + U * z64.shape[-1]
    check_fp32("engine log-probs vs the packed forward", batch.old_logp, ref, truth, tol)


def test_sliding_window_qwen3_takes_the_hf_path():
    model, tok = _qwen3(seed=2, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    exact = float64_copy(model)
    assert "sliding_attention" in model.config.layer_types
    assert not LeanStepper.supports(model)
    eng = TorchEngine(model, tok)
    with torch.inference_mode():
        stepper = eng._prefill(model, torch.device("cpu"), [[5, 6, 7], [8, 9]], 4)[0]
    assert isinstance(stepper, HFStepper)
    eng.eos_ids = set()
    out = eng.generate(PROMPTS[:2], 1, SamplingConfig(temperature=0, max_new_tokens=8))
    for p, grp in zip(PROMPTS, out):  # the engine pads the two prompts into one batch, generate does not
        check_greedy_pair(p, exact, tok(p, add_special_tokens=False)["input_ids"], grp[0].token_ids,
                          _hf_greedy(model, tok, p, 8))
