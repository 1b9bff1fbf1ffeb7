"""fastgrpo's fast paths on a real pretrained model, SmolLM2-135M-Instruct (Llama: 30 layers, hidden
576, head_dim 64, GQA 9:3, tied embeddings, vocab 49 152), against the HF model itself.

Each float32 path is held to the float64 model next to the HF model's own float32 forward, by the
shared oracle rule (tests/fp32_oracle.py: rms error ≤ the float32 reference's + U·depth·scale, so
the bounds hold on any x86 CPU): the native decode step (here with its streamed GEMMs, the layout
a model of this size takes) and the Python step, on one and on two threads; the built-in engine's
rollouts (tokens = float64's draws for the seeds' uniforms, log-probs float32-close, through
rollout_oracle.check_engine); the packed training forward with shared prompts through the fused
decoder layers and the oneDNN linears (fastgrpo.models.patch), log-probs and gradients. A short
prompt set (the chat template applied where decoding, as a run applies it; a few raw tokens for
the float64 forward + backward) keeps the file near a minute and a half on two cores; the model
is loaded once per module.
"""
from __future__ import annotations

import copy

import pytest
import torch

from fastgrpo.models.packed import packed_logprobs
from fastgrpo.models.patch import patch_model
from fastgrpo.packing import build_packed_batches
from fastgrpo.rollout.base import SamplingConfig
from fastgrpo.rollout.decoders import LeanStepper
from fastgrpo.rollout.torch_engine import TorchEngine
from model_oracle import check_model_run
from fp32_oracle import check_fp32, fp32_tol

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
from rollout_oracle import check_engine, decode_depth  # noqa: E402

QUESTIONS = ["What is 7 plus 5?", "Sara had 45 stickers and gave away 17. How many are left?"]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    """(float32 model, tokenizer, float64 copy, chat-templated prompt ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 30 and model.config.head_dim == 64
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (9, 3)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    exact = copy.deepcopy(model).double().eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return model, tok, exact, ids


def _left_padded(ids):
    width = max(len(p) for p in ids)
    x = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for r, p in enumerate(ids):
        x[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return x, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _stepper(model, x, mask, pos, native, budget):
    res = model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    return LeanStepper(model, res.past_key_values, mask, budget, native=native), res.logits[:, -1]


@pytest.mark.parametrize("threads", [1, 2])
def test_native_and_python_decode_steps_agree_with_hf(smollm2, threads):
    """Prefill by the HF forward, then decode steps (a row leaving the batch midway): the native
    step (streamed layout: weights as nn.Linear holds them, q/k/v apart, the tied lm_head read in
    place) and the Python step against the float64 Python step, logits and the HF float32
    forward's next-token logits at the first step."""
    model, _, exact, ids = smollm2
    x, mask, pos = _left_padded(ids * 2)  # 4 rows
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the references on one thread; the native step on `threads`

    def native_step(*args):
        torch.set_num_threads(threads)
        try:
            return nat.step(*args)
        finally:
            torch.set_num_threads(1)

    try:
        with torch.inference_mode():
            nat, _ = _stepper(model, x, mask, pos, True, 8)
            py, _ = _stepper(model, x, mask, pos, False, 8)
            ref, _ = _stepper(exact, x, mask, pos, False, 8)
            assert nat.native is not None and py.native is None
            assert len(nat._streamed) == 3 * 30 and nat._lm_streamed
            assert nat._lm_wt.data_ptr() == model.lm_head.weight.data_ptr()  # no copy of the 113 MB head
            nxt, p = torch.tensor([28, 1000, 9, 4]), pos[:, -1] + 1
            depth = decode_depth(model.config, x.shape[1] + 4)
            for t in range(3):
                a, b, r = native_step(nxt, p, t), py.step(nxt, p, t), ref.step(nxt, p, t)
                check_fp32(f"{threads} threads, step {t} logits", a, b, r, fp32_tol(depth, r))
                if t == 0:  # the HF module's own forward on the whole sequence, float32
                    full = torch.cat([x, nxt[:, None]], 1)
                    fm = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                    hf = model(input_ids=full, attention_mask=fm, position_ids=torch.cat([pos, p[:, None]], 1)).logits
                    check_fp32("HF forward, step 0", a, hf[:, -1], r, fp32_tol(depth, r))
                nxt, p = r.argmax(-1), p + 1
                if t == 1:
                    keep = torch.tensor([0, 1, 3])
                    for s in (nat, py, ref):
                        s.select(keep)
                    nxt, p = nxt[keep], p[keep]
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow  # ~25 s on 2 cores: float64 teacher-forced passes of a 135M model
def test_engine_rollouts_are_the_float64_models_draws(smollm2):
    """The built-in engine (decoder auto: HF prefill for a model this size, native streamed steps,
    native sampler) on chat-templated prompts, G = 2: every token is what the float64 model draws
    for its seed's uniforms, log-probs float32-close (rollout_oracle.check_engine)."""
    model, tok, exact, ids = smollm2
    sp = SamplingConfig(temperature=1.0, max_new_tokens=4, seed=11)
    out = TorchEngine(model, tok, num_threads=1).generate(ids[:1], 2, sp)
    assert [len(g) for g in out] == [2]
    check_engine("native engine", model, tok, ids[:1], out, sp, exact)


def _padded_logprobs(model, prompts, comps):
    seqs = [p + c for p, c in zip(prompts, comps)]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    att = torch.zeros(len(seqs), T, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = torch.tensor(s)
        att[r, :len(s)] = 1
    logits = model(input_ids=ids, attention_mask=att).logits
    logp = (logits if logits.dtype == torch.float64 else logits.float()).log_softmax(-1)
    return torch.cat([logp[r, len(p) - 1:len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None])[:, 0]
                      for r, (p, c) in enumerate(zip(prompts, comps))])


# gradients compared: the tied embedding / lm_head and the first and last layers' matrices
_GRADS = ("model.embed_tokens.weight", "model.norm.weight") + tuple(
    f"model.layers.{i}.{n}.weight" for i in (0, 29)
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"))


@pytest.mark.slow  # ~30 s on 2 cores: a float64 forward + backward of a 135M model
def test_packed_fused_forward_and_backward_agree_with_hf(smollm2):
    """A GRPO micro-batch (2 prompts × G 2, shared prompts) through the packed forward on the
    patched model (fused decoder layers, oneDNN linears) next to the HF model's own padded
    float32 forward, both against float64: completion log-probs and the gradients of a weighted
    sum of them."""
    model, tok, exact, _ = smollm2
    ids = [tok(q, add_special_tokens=False)["input_ids"] for q in ("What is 7 plus 5?", "Add 3 and 4.")]
    fused = copy.deepcopy(model).train()
    swapped = patch_model(fused)
    assert swapped["fused_layers"] == 30
    prompts = [ids[0], ids[0], ids[1], ids[1]]
    comps = [[504, 3460, 314, 216], [1380, 28], [504, 3460, 314], [2, 216, 37]]
    batch = build_packed_batches(prompts, comps, [0.0] * 4, 10 ** 6, group_size=2, share_prefix=True,
                                 attn_coef=10 ** 6)[0]
    assert batch.segment_prefix is not None
    order = batch.seq_index.tolist()
    coef = torch.linspace(-1.0, 2.0, batch.num_completion_tokens)
    fused.zero_grad()
    lp = packed_logprobs(fused, batch)
    (lp * coef).sum().backward()
    runs = {"fused": {"logp": lp.detach().double(),
                      **{k: p.grad.double() for k, p in fused.named_parameters() if k in _GRADS}}}
    for name, m in (("ref", model), ("truth", exact)):
        m.zero_grad()
        ref = _padded_logprobs(m, [prompts[i] for i in order], [comps[i] for i in order])
        (ref * coef.to(ref.dtype)).sum().backward()
        runs[name] = {"logp": ref.detach().double(),
                      **{k: p.grad.double() for k, p in m.named_parameters() if k in _GRADS}}
        m.zero_grad(set_to_none=True)
    keys = max(len(p) + len(c) for p, c in zip(prompts, comps))
    check_model_run("SmolLM2 packed fused", model.config, keys, batch.input_ids.numel(), runs["fused"], runs["ref"],
                    runs["truth"])
