"""fastgrpo's own trainer on a Gemma 2 model (tiny, built from a `Gemma2Config`: hidden 64, 2
layers, final_logit_softcapping 5, attention-score soft cap 3, alternating sliding-window
layers): the final-logit cap runs inside the loss / scoring kernels (`LossConfig.softcap`), the
packed CPU attention runs Gemma 2's capped, windowed attention exactly, old log-probs equal the
loss's at step 0 (ratio 1 on-policy), and the loss's gradient equals the torch-op path's (cap by
torch ops on the [N, V] logits, then the uncapped loss) in float64."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from fastgrpo.loss import grpo_loss
from fastgrpo.models.packed import head_softcap, lm_head_logits, packed_forward, packed_logits
from fastgrpo.models.tiny import build_char_tokenizer
from fastgrpo.packing import build_packed_batches
from fastgrpo.trainer.grpo import Trainer
from trainer_helpers import NoisyTask


def _gemma2(tok, dtype=torch.float64, sliding_window=256):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                       final_logit_softcapping=5.0, attn_logit_softcapping=3.0, sliding_window=sliding_window,
                       max_position_embeddings=512, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.bos_token_id, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # logits of std ~3 (the init gives ~0.2): a cap of 5 then bends them
        model.lm_head.weight.mul_(15.0)
        for layer in model.model.layers:  # attention scores of a few units: the score cap of 3 bends them
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


def _batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g) for _ in range(n)]
    comps = [torch.randint(3, 60, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g) for _ in range(n)]
    return prompts, comps, build_packed_batches(prompts, comps, [0.5] * n, 512)[0]


def test_gemma2_packed_forward_runs_capped_windowed_attention_as_eager():
    """The varlen packed forward (softcapped scores, sliding windows that cover every sequence)
    gives the log-probs of transformers' eager attention run one sequence at a time; the model's
    logits are capped (|z| < 5) and the cap matters (the uncapped head reaches past it)."""
    tok = build_char_tokenizer()
    model = _gemma2(tok).eval().requires_grad_(False)
    prompts, comps, b = _batch()
    got = packed_logits(model, b)
    eager = _gemma2(tok).eval().requires_grad_(False)
    eager.config._attn_implementation = "eager"
    want = []
    for i in b.seq_index.tolist():
        ids = torch.cat([prompts[i], comps[i]])[None]
        p, c = len(prompts[i]), len(comps[i])
        want.append(eager(input_ids=ids).logits[0, p - 1:p + c - 1])
    want = torch.cat(want)
    assert float(got.abs().max()) < 5.0
    assert float((lm_head_logits(model, packed_forward(model, b), softcap=False).abs()).max()) > 6.0
    # eager's softmax runs in float32 even for a float64 model: agreement to float32 rounding
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the attention cap is applied: without it (plain SDPA) the logits differ
    plain = _gemma2(tok).eval().requires_grad_(False)
    for layer in plain.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert float((packed_logits(plain, b) - got).abs().max()) > 1e-3


def test_gemma2_window_shorter_than_a_sequence_is_a_clear_error():
    tok = build_char_tokenizer()
    model = _gemma2(tok, sliding_window=4).eval()
    _, _, b = _batch()
    with pytest.raises(ValueError, match=r"sliding_window=4: this gemma2 model's sliding-window layers"):
        packed_logits(model, b)


def _trainer(cfg_factory, model, tok, *extra):
    cfg = cfg_factory("steps=1", "algorithm.inner_steps=2", "algorithm.beta=0.04", *extra)
    return Trainer(cfg, model, tok, task=NoisyTask(), log=lambda m: None)


def test_grpo_step_on_gemma2_caps_in_the_kernel_ratio_one_and_torch_op_gradient(cfg_factory):
    tok = build_char_tokenizer()
    model = _gemma2(tok)  # float64: the two paths are compared to rounding of the double precision
    t = _trainer(cfg_factory, model, tok)
    assert head_softcap(model) == 5.0 and t.loss_cfg.softcap == 5.0
    rnd = t._round(t.cfg.rollout.prompts_per_step)
    batches = [b for b in t._pack(rnd.problems, rnd.groups, rnd.adv, rnd.keep) if b is not None]
    assert batches, "the step must have something to learn from"
    t._old_logp(batches)  # inner_steps = 2: old log-probs by the scorer; β > 0: reference log-probs too
    assert all(b.old_logp is not None and b.ref_logp is not None for b in batches)
    totals = {"tokens": float(sum(b.num_loss_tokens for b in batches)),
              "seqs": float(sum(b.num_seqs for b in batches))}
    t._update_state = SimpleNamespace(nonfinite=False, tokens=0.0, loss=0.0, sums={}, extremes={})
    fn = t._loss_fn(totals)
    module = t.backend.module
    module.train()
    kernel, torch_op = [], []
    for b in batches:
        module.zero_grad()
        fn(module, b).backward()
        kernel.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        module.zero_grad()
        bb = b.to("cpu")
        logits = lm_head_logits(module, packed_forward(module, bb))  # capped by torch ops on [N, V]
        out = grpo_loss(logits, bb.targets, bb.advantages, mask=bb.loss_mask, old_logp=bb.old_logp,
                        ref_logp=bb.ref_logp, cu_seqlens=bb.loss_cu_seqlens,
                        config=dataclasses.replace(t.loss_cfg, softcap=None), num_items=totals["tokens"],
                        impl="reference")
        (out.loss * t.backend.loss_scale).backward()
        torch_op.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        with torch.no_grad():  # the ratio check below has teeth: scoring without the cap is far off
            uncapped = lm_head_logits(module, packed_forward(module, bb), softcap=False)
            lp = torch.log_softmax(uncapped, -1).gather(1, bb.targets[:, None])[:, 0]
            assert float((lp - bb.old_logp.double()).abs().max()) > 1e-2
    st = t._update_state
    assert not st.nonfinite
    # on-policy at step 0: the scorer's old log-probs are the loss's (same cap, same kernel), up to
    # the trainer storing them in float32 (one ulp of 1 is 1.2e-7; an uncapped scorer is off by > 1e-2)
    assert abs(st.extremes["ratio_min"] - 1.0) < 1e-6 and abs(st.extremes["ratio_max"] - 1.0) < 1e-6
    assert abs(st.sums["kl_mean"]) < 1e-9  # the reference is the policy: KL 0
    for k, r in zip(kernel, torch_op):
        assert k.keys() == r.keys() and "lm_head.weight" in k or "model.embed_tokens.weight" in k
        for name in k:
            torch.testing.assert_close(k[name], r[name], rtol=1e-9, atol=1e-12, msg=name)
    assert any(float(g.abs().max()) > 0 for g in kernel[0].values())
    # and the whole step through the trainer (rollouts with the capped attention, two inner steps)
    logs = t.step()
    assert torch.isfinite(torch.tensor(logs["train/loss"])) and logs.get("train/skipped", 0.0) == 0.0


def test_bf16_gemma2_scores_old_logprobs_with_the_losss_cap(cfg_factory):
    """A bf16 model's own head caps its bf16 logits and rounds the result to bf16 again (steps of
    1/64 near the cap of 5): scoring through it would put the ratio of an on-policy step off 1.
    The trainer's scorer (`_logprobs_of` → packed_head_logits) caps in the kernel as the loss does."""
    from fastgrpo.loss import token_logprobs

    tok = build_char_tokenizer()
    model = _gemma2(tok, dtype=torch.bfloat16).eval()
    t = _trainer(cfg_factory, model, tok)
    _, _, b = _batch(seed=3)
    old = t._logprobs_of(t.backend.module, b)
    with torch.no_grad():
        hidden = packed_forward(model, b)
        loss_logp = grpo_loss(lm_head_logits(model, hidden, softcap=False), b.targets, b.advantages.float(),
                              config=dataclasses.replace(t.loss_cfg, beta=0.0), impl="torch").logp
        via_head, _ = token_logprobs(packed_logits(model, b), b.targets, t.loss_cfg.temperature, impl="torch")
    assert float((old - loss_logp).abs().max()) < 1e-6
    assert float((via_head - loss_logp).abs().max()) > 1e-3
