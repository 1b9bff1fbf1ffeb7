"""Qwen3 in the built-in engine's lean decoder (fastgrpo/rollout/_decode.py LeanStepper and its
native step, lean_step.cpp): q_norm / k_norm (a per-head RMSNorm before RoPE) in both steps,
against a float64 HF step, the HF forward (native prefill), HF `generate` (greedy) and a packed
forward (sampled log-probs); a sliding-window Qwen3 stays on the HF module."""
import copy

import pytest
import torch

from fastgrpo.models.tiny import build_char_tokenizer
from fastgrpo.models.packed import packed_logprobs
from fastgrpo.packing.layout import build_packed_batches
from fastgrpo.rollout import SamplingConfig
from fastgrpo.rollout.decoders import HFStepper, LeanStepper
from fastgrpo.rollout.torch_engine import TorchEngine

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
    """The native and the Python lean step (float32) against the HF module stepping in float64:
    logits and cached keys / values step after step (left padding; rows dropped midway)."""
    model, _ = _qwen3(heads, kv, head_dim, bias)
    assert LeanStepper.supports(model)
    exact = copy.deepcopy(model).double()
    ids, mask, pos = _prompts()
    W = ids.shape[1]
    with torch.inference_mode():
        res = _prefill(model, ids, mask, pos)
        nat = LeanStepper(model, res.past_key_values, mask, 20, native=True)
        res = _prefill(model, ids, mask, pos)
        py = LeanStepper(model, res.past_key_values, mask, 20, native=False)
        assert nat.native is not None and py.native is None
        ref = HFStepper(exact, _prefill(exact, ids, mask, pos).past_key_values, mask.clone())
        nxt, gen = pos[:, -1] + 1, torch.Generator().manual_seed(2)
        errs = []
        for t in range(10):
            tok = torch.randint(3, 40, (len(nxt),), generator=gen)
            a, b, r = nat.step(tok, nxt, t), py.step(tok, nxt, t), ref.step(tok, nxt, t)
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == r.shape
            errs.append(((a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()))
            n = W + t + 1
            for i in range(len(model.model.layers)):
                k_ref, v_ref = ref.cache.layers[i].keys[:, :, :n], ref.cache.layers[i].values[:, :, :n]
                real = torch.cat([mask, mask.new_ones((mask.shape[0], t + 1))], 1).bool()  # pads: unwritten by HF
                for s in (nat, py):
                    k, v = _keys(s, i, n).double(), s.v[i][:, :, :n].double()
                    torch.testing.assert_close(k.permute(0, 2, 1, 3)[real], k_ref.permute(0, 2, 1, 3)[real],
                                               rtol=1e-4, atol=5e-5)
                    torch.testing.assert_close(v.permute(0, 2, 1, 3)[real], v_ref.permute(0, 2, 1, 3)[real],
                                               rtol=1e-4, atol=5e-5)
            nxt = nxt + 1
            if t == 4:  # rows finish: all three drop them
                keep = torch.tensor([0, 2, 3, 5])
                nat.select(keep), py.select(keep), ref.select(keep)
                nxt, mask = nxt[keep], mask[keep]
    # logits of magnitude ~10: both float32 steps are ~1e-5 off the float64 one, neither drifts
    assert max(e[0] for e in errs) < 2e-4 and max(e[1] for e in errs) < 2e-4, errs


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
    model, _ = _qwen3(heads, kv, head_dim, bias, seed=1)
    B, W = 5, 9
    ids = torch.randint(3, 40, (B, W), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(B, W, dtype=torch.long)
    mask[0, :6] = 0
    mask[2, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        nat, logits = LeanStepper.native_prefill(model, ids, mask, 6)
        res = _prefill(model, ids, mask, pos)
        torch.testing.assert_close(logits, res.logits[:, -1].float(), rtol=1e-4, atol=2e-5)
        real = mask.bool()
        for i in range(len(model.model.layers)):
            k_ref, v_ref = res.past_key_values.layers[i].keys, res.past_key_values.layers[i].values
            torch.testing.assert_close(_keys(nat, i, W).permute(0, 2, 1, 3)[real], k_ref.permute(0, 2, 1, 3)[real],
                                       rtol=1e-4, atol=2e-5)
            torch.testing.assert_close(nat.v[i][:, :, :W].permute(0, 2, 1, 3)[real], v_ref.permute(0, 2, 1, 3)[real],
                                       rtol=1e-4, atol=2e-5)


def _hf_greedy(model, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("decoder", ["auto", "lean"])
@pytest.mark.parametrize("heads,kv,head_dim,bias", SHAPES)
def test_greedy_equals_hf_generate(decoder, heads, kv, head_dim, bias):
    model, tok = _qwen3(heads, kv, head_dim, bias, seed=3)
    eng = TorchEngine(model, tok, decoder=decoder)
    eng.eos_ids = set()  # full-length sequences, as HF's with eos_token_id=None
    out = eng.generate(PROMPTS, 1, SamplingConfig(temperature=0, max_new_tokens=12))
    for p, grp in zip(PROMPTS, out):
        assert grp[0].token_ids == _hf_greedy(model, tok, p, 12), p


@pytest.mark.parametrize("heads,kv,head_dim,bias", SHAPES)
def test_sampled_logprobs_equal_a_packed_forward(heads, kv, head_dim, bias):
    """Native prefill, native steps and native sampler: the log-prob reported for each sampled
    token equals the trainer's packed forward over prompt ‖ completion."""
    model, tok = _qwen3(heads, kv, head_dim, bias, seed=5)
    out = TorchEngine(model, tok).generate(PROMPTS, 3, SamplingConfig(temperature=0.8, max_new_tokens=16, seed=1))
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS for _ in range(3)]
    comps = [c for grp in out for c in grp]
    assert all(c.token_ids for c in comps) and len({tuple(c.token_ids) for c in out[1]}) > 1
    batch = build_packed_batches(prompts, [c.token_ids for c in comps], [0.0] * len(comps), 10 ** 6,
                                 old_logp=[c.logprobs for c in comps])[0]
    with torch.no_grad():
        ref = packed_logprobs(model, batch, temperature=0.8)
    torch.testing.assert_close(batch.old_logp, ref, rtol=0, atol=1e-4)


def test_sliding_window_qwen3_takes_the_hf_path():
    model, tok = _qwen3(seed=2, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    assert "sliding_attention" in model.config.layer_types
    assert not LeanStepper.supports(model)
    eng = TorchEngine(model, tok)
    with torch.inference_mode():
        stepper = eng._prefill(model, torch.device("cpu"), [[5, 6, 7], [8, 9]], 4)[0]
    assert isinstance(stepper, HFStepper)
    eng.eos_ids = set()
    out = eng.generate(PROMPTS[:2], 1, SamplingConfig(temperature=0, max_new_tokens=8))
    for p, grp in zip(PROMPTS, out):
        assert grp[0].token_ids == _hf_greedy(model, tok, p, 8), p
