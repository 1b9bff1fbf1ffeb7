"""Built-in torch engine on tiny Llama / Qwen2 models: greedy equals HF generate, sampled
log-probs equal a forward pass's, top-k / top-p semantics, seeds, stops, weight updates.

Two float32 paths (the lean / native decoder and the HF module, a row alone and in a batch
with other padding) round differently, by amounts that depend on the CPU: each completion is
checked against the float64 model on its own tokens (rollout_oracle.check_rollouts), and two
paths' tokens must agree unless they part where float64 puts a draw within rounding of a tie or
a CDF boundary. Runs of one path on the same batch are bit-identical and compared exactly."""
import pytest
import torch

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import SamplingConfig, make_engine
from fastgrpo.rollout.torch_engine import TorchEngine, process_logits
from rollout_oracle import (U, ELEMENT_SPREAD, check_engine, check_greedy_pair, check_rollouts, decode_depth,
                            float64_copy, fp32_tol, process64, teacher_forced_logits)

PROMPTS = ["1+2=", "12*34-5=", "a", "(7+8)*9="]


def _model(arch, head_dim, seed=3, tie=True, kv_heads=1):
    heads = 64 // head_dim
    model, tok = build_tiny_model(arch, seed=seed, head_dim=head_dim, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, tie_word_embeddings=tie)
    # the random init is nearly flat; a perturbation gives prompt-dependent, varied outputs
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model, tok


def _hf_greedy(model, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch, head_dim", [("llama", 32), ("qwen2", 64)])
def test_greedy_equals_hf_generate(arch, head_dim):
    model, tok = _model(arch, head_dim)
    exact = float64_copy(model)
    eng = TorchEngine(model, tok)
    eng.eos_ids = set()             # compare full-length sequences with HF (eos_token_id=None there)
    sp = SamplingConfig(temperature=0, max_new_tokens=10)
    out = eng.generate(PROMPTS, 1, sp)
    for p, grp in zip(PROMPTS, out):
        c = grp[0]
        assert c.finish_reason == "length" and len(c.logprobs) == 10
        check_greedy_pair(p, exact, tok(p, add_special_tokens=False)["input_ids"], c.token_ids,
                          _hf_greedy(model, tok, p, 10))
    # every token float64's argmax (up to rounding); greedy log-probs are log_softmax of the raw logits (τ = 1)
    check_engine("greedy", model, tok, PROMPTS, out, sp, exact)


@pytest.mark.parametrize("arch, head_dim", [("llama", 64), ("qwen2", 32)])
def test_sampled_logprobs_equal_forward_pass(arch, head_dim):
    model, tok = _model(arch, head_dim, seed=5)
    eng = make_engine("torch", model, tok)
    sp = SamplingConfig(temperature=0.7, max_new_tokens=12, seed=1)
    out = eng.generate(PROMPTS, 3, sp)
    check_engine("sampled", model, tok, PROMPTS, out, sp)
    assert len({tuple(c.token_ids) for c in out[1]}) > 1, "three samples of one prompt were identical"


def test_top_k_top_p_logprobs_are_of_the_truncated_distribution():
    """Tokens and log-probs of the top-k / top-p truncated distribution, against its float64
    truncation (check_engine: steps whose truncation float64 puts within rounding of a boundary
    only check that the token is one some float32 path may keep)."""
    model, tok = _model("qwen2", 32, seed=7)
    exact = float64_copy(model)
    eng = TorchEngine(model, tok)
    s = SamplingConfig(temperature=0.9, top_k=5, top_p=0.8, max_new_tokens=8, seed=3)
    out = eng.generate(PROMPTS, 2, s)
    check_engine("top-k / top-p", model, tok, PROMPTS, out, s, exact)
    for p, grp in zip(PROMPTS, out):
        ids = tok(p, add_special_tokens=False)["input_ids"]
        for c in grp:
            z32 = teacher_forced_logits(model, ids, c.token_ids).float()
            assert ((process_logits(z32, 0.9, 5, 0.8) > float("-inf")).sum(-1) <= 5).all()
            z64 = teacher_forced_logits(exact, ids, c.token_ids).double() / 0.9
            tol = fp32_tol(decode_depth(model.config, len(ids) + len(c.token_ids)), z64 * 0.9) / 0.9
            for t, y in enumerate(c.token_ids):
                maybe = process64(z64[t], 5, 0.8, ELEMENT_SPREAD * tol)[2]
                assert bool(maybe[y]), "sampled a truncated token"
                # renormalised: never below the untruncated log-prob (up to the float32 log-prob bound)
                plain = float(z64[t].log_softmax(-1)[y])
                assert c.logprobs[t] >= plain - (2 * tol + U * z64.shape[-1])


def test_process_logits_top_p_keeps_smallest_set_reaching_p():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # p just below / above the mass 0.8 of the first two: exactly at it, the float32 softmax and
    # cumsum round to 0.8 ± a few ulps depending on the CPU's exp (so either answer is right);
    # 1e-4 is ≫ those (4 terms: ≤ ~8 ulps ≈ 5e-7) and ≪ the masses
    kept = process_logits(z, 1.0, 0, 0.8 - 1e-4) > float("-inf")
    assert kept.tolist() == [[True, True, False, False]]
    kept = process_logits(z, 1.0, 0, 0.8 + 1e-4) > float("-inf")
    assert kept.tolist() == [[True, True, True, False]]
    kept = process_logits(z, 1.0, 0, 0.81) > float("-inf")
    assert kept.tolist() == [[True, True, True, False]]
    kept = process_logits(z, 1.0, 0, 0.1) > float("-inf")
    assert kept.tolist() == [[True, False, False, False]]


def test_seeds_reproduce_and_do_not_depend_on_the_batch():
    model, tok = _model("llama", 32, seed=9)
    eng = TorchEngine(model, tok)
    s = SamplingConfig(temperature=1.0, max_new_tokens=12, seed=4)
    a = eng.generate(PROMPTS, 2, s)
    b = eng.generate(PROMPTS, 2, s)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]  # same path: bit-equal
    c = eng.generate(PROMPTS, 2, SamplingConfig(temperature=1.0, max_new_tokens=12, seed=5))
    assert [[x.token_ids for x in g] for g in a] != [[x.token_ids for x in g] for g in c]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    alone = eng._sample([ids[2]], s, 12, [77])[0]
    batched = eng._sample([ids[1], ids[2], ids[3]], s, 12, [1, 77, 2])[1]
    # alone and batched, the row is padded differently (other float32 rounding): both are the
    # float64 model's draws for seed 77, so they are equal unless a draw sits on a boundary
    exact = float64_copy(model)
    for name, comp in (("alone", alone), ("batched", batched)):
        check_rollouts(name, model, [ids[2]], [comp], temperature=1.0, seeds=[77], budget=12, model64=exact)


def test_stop_ids_and_strings():
    model, tok = _model("qwen2", 32)
    eng = TorchEngine(model, tok)
    eng.eos_ids = set()
    greedy = eng.generate(["1+2="], 1, SamplingConfig(temperature=0, max_new_tokens=10))[0][0]
    third = greedy.token_ids[2]
    c = eng.generate(["1+2="], 1, SamplingConfig(temperature=0, max_new_tokens=10, stop_token_ids=(third,)))[0][0]
    assert c.finish_reason == "stop" and c.token_ids == greedy.token_ids[:greedy.token_ids.index(third) + 1]
    stop_str = tok.decode(greedy.token_ids[3:5])
    c = eng.generate(["1+2="], 1, SamplingConfig(temperature=0, max_new_tokens=10, stop=(stop_str,)))[0][0]
    assert c.finish_reason == "stop" and c.text.endswith(stop_str) and len(c.token_ids) <= 5


def test_update_weights_shared_and_copied():
    model, tok = _model("llama", 32, seed=11)
    shared = TorchEngine(model, tok)
    copied = make_engine("torch", model, tok, copy_model=True)
    g = SamplingConfig(temperature=0, max_new_tokens=8)
    before = [c[0].token_ids for c in copied.generate(PROMPTS, 1, g)]
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    ids = torch.tensor([tok("1+2=3", add_special_tokens=False)["input_ids"]])
    model(ids, labels=ids).loss.backward()
    opt.step()
    after_shared = [c[0].token_ids for c in shared.generate(PROMPTS, 1, g)]
    assert [c[0].token_ids for c in copied.generate(PROMPTS, 1, g)] == before    # stale until synced
    assert after_shared != before
    assert shared.update_weights(model).nbytes == 0                              # same module: nothing to copy
    stats = copied.update_weights(model)
    assert stats.nbytes == sum(p.numel() * 4 for p in model.parameters())
    assert [c[0].token_ids for c in copied.generate(PROMPTS, 1, g)] == after_shared
    with pytest.raises(ValueError, match=r"no parameters named \['bogus'\]"):
        copied.update_weights(list(model.named_parameters()) + [("bogus", torch.zeros(1))])


# ---- the fast decode path: lean decoder, compaction, prefill dedup, vectorised sampling, threads

MIXED = ["1+2=", "12*34-5=", "1+2=", "a", "1+2=", "(7+8)*9="]   # repeated prompts: prefill dedup


def _outputs(eng, prompts, s, seeds):
    eng.eos_ids = set()             # the cases pick their own stop ids
    ids = [eng._encode(p, i) for i, p in enumerate(prompts)]
    return eng._sample(ids, s, s.max_new_tokens, seeds)


def _check_paths(name, model, prompts, s, seeds, pairs, model64):
    """Each completion of each path against float64 (check_rollouts); a pair of paths with equal
    tokens also has equal finish reasons (tokens may differ only after a float64 tie, which
    check_rollouts has accepted on each path)."""
    for label, outs in pairs.items():
        check_rollouts(f"{name} {label}", model, prompts, outs, temperature=s.temperature, seeds=seeds,
                       budget=s.max_new_tokens, model64=model64)
    first, *rest = pairs.values()
    for other in rest:
        for a, b in zip(first, other):
            if a.token_ids == b.token_ids:
                assert a.finish_reason == b.finish_reason


@pytest.mark.parametrize("arch, head_dim, kv_heads", [("llama", 32, 1), ("qwen2", 32, 1), ("qwen2", 64, 1),
                                                      ("llama", 16, 2)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lean_decoder_equals_hf_module_path(arch, head_dim, kv_heads, temperature):
    model, tok = _model(arch, head_dim, seed=13, tie=arch == "qwen2", kv_heads=kv_heads)
    exact = float64_copy(model)
    seeds = list(range(40, 40 + len(MIXED)))
    hf_engine = TorchEngine(model, tok, decoder="hf")
    free = _outputs(hf_engine, MIXED, SamplingConfig(temperature, max_new_tokens=14), seeds)
    # a stop id the first completion emits at step 3: that row finishes early, others may not
    s = SamplingConfig(temperature=temperature, max_new_tokens=14, stop_token_ids=(free[0].token_ids[2],))
    lean = _outputs(TorchEngine(model, tok), MIXED, s, seeds)
    hf = _outputs(TorchEngine(model, tok, decoder="hf"), MIXED, s, seeds)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in MIXED]
    _check_paths("lean vs hf", model, prompts, s, seeds, {"lean": lean, "hf": hf}, exact)
    # the HF path computes exactly as without the stop id until row 0 stops: at step 3 or before
    assert hf[0].finish_reason == "stop" and len(hf[0].token_ids) <= 3
    if lean[0].token_ids[:3] == hf[0].token_ids[:3]:
        assert lean[0].token_ids == hf[0].token_ids and lean[0].finish_reason == "stop"


@pytest.mark.parametrize("compact, decoder", [(None, "auto"), ("every", "auto"), ("never", "auto"), ("every", "hf"),
                                              (None, "hf")])
def test_compaction_and_dedup_do_not_change_a_completion(monkeypatch, compact, decoder):
    """Rows that stop early leave the batch (after every finish, once a quarter of the batch has
    finished — the default —, or never: finished rows ride along) and repeated prompts share one
    prefill; every completion must still be the one its seed gives alone: both are the float64
    model's draws for the seed (check_rollouts), with the forward pass's log-probs, also after
    other rows were dropped."""
    import fastgrpo.rollout.torch_engine as te

    if compact is not None:
        at = 1 if compact == "every" else 10 ** 9
        monkeypatch.setattr(te, "_compact_at", lambda rows, small: at)
    model, tok = _model("qwen2", 32, seed=17)
    exact = float64_copy(model)
    eng = TorchEngine(model, tok, decoder=decoder)
    s = SamplingConfig(temperature=1.0, max_new_tokens=16, stop_token_ids=(7, 11))
    seeds = [3 * i + 1 for i in range(len(MIXED))]
    batched = _outputs(eng, MIXED, s, seeds)
    lengths = {len(c.token_ids) for c in batched}
    assert len(lengths) > 1 and "stop" in {c.finish_reason for c in batched}
    alone = [_outputs(eng, [p], s, [seed])[0] for p, seed in zip(MIXED, seeds)]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in MIXED]
    _check_paths("compaction", model, prompts, s, seeds, {"batched": batched, "alone": alone}, exact)
    for c in batched + alone:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in (7, 11) and not set(c.token_ids[:-1]) & {7, 11}


def test_stop_token_on_the_last_step_is_a_stop():
    model, tok = _model("llama", 32, seed=3)
    eng = TorchEngine(model, tok)
    eng.eos_ids = set()
    greedy = eng.generate(["1+2="], 1, SamplingConfig(temperature=0, max_new_tokens=6))[0][0]
    last = greedy.token_ids[-1]
    first = greedy.token_ids.index(last) + 1
    c = eng.generate(["1+2="], 1, SamplingConfig(temperature=0, max_new_tokens=first, stop_token_ids=(last,)))[0][0]
    assert c.finish_reason == "stop" and len(c.token_ids) == first


def test_unsupported_architecture_falls_back_to_the_hf_module():
    from transformers import GPT2Config, GPT2LMHeadModel

    from fastgrpo.models.tiny import build_char_tokenizer
    from fastgrpo.rollout.decoders import LeanStepper

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=2, n_positions=64))
    assert not LeanStepper.supports(model)
    eng = TorchEngine(model, tok)
    eng.eos_ids = set()
    sp = SamplingConfig(temperature=0, max_new_tokens=6)
    out = eng.generate(PROMPTS, 1, sp)
    exact = float64_copy(model)
    check_engine("gpt2", model, tok, PROMPTS, out, sp, exact)
    for p, grp in zip(PROMPTS, out):  # the engine pads the four prompts into one batch, generate does not
        check_greedy_pair(p, exact, tok(p, add_special_tokens=False)["input_ids"], grp[0].token_ids,
                          _hf_greedy(model, tok, p, 6))


def test_threads_are_restored_and_arguments_checked():
    model, tok = _model("qwen2", 32)
    before = torch.get_num_threads()
    TorchEngine(model, tok, num_threads=1).generate(["1+2="], 2, SamplingConfig(max_new_tokens=4, seed=0))
    TorchEngine(model, tok).generate(["1+2="], 2, SamplingConfig(max_new_tokens=4, seed=0))
    assert torch.get_num_threads() == before
    assert TorchEngine(model, tok)._threads(64) == 1            # tiny step: one thread
    assert TorchEngine(model, tok, num_threads=3)._threads(64) == 3
    with pytest.raises(ValueError, match="num_threads=0"):
        TorchEngine(model, tok, num_threads=0)
    with pytest.raises(ValueError, match="decoder='vllm'"):
        TorchEngine(model, tok, decoder="vllm")


STOPS = ("5", "x")


@pytest.mark.parametrize("compact", [None, "never"])
def test_stop_strings_with_finished_rows_in_the_batch(monkeypatch, compact):
    """Stop strings are checked on live rows only: a finished row that rides along in the batch
    (lazy compaction) keeps the length and finish reason it stopped with."""
    import fastgrpo.rollout.torch_engine as te

    if compact == "never":
        monkeypatch.setattr(te, "_compact_at", lambda rows, small: 10 ** 9)
    model, tok = _model("qwen2", 32, seed=17)
    eng = TorchEngine(model, tok)
    eng.eos_ids = set()
    # strings these seeds' completions contain at different steps (some rows never: "length")
    s = SamplingConfig(temperature=1.0, max_new_tokens=16, stop=STOPS)
    seeds = [5 * i + 2 for i in range(len(MIXED))]
    batched = _outputs(eng, MIXED, s, seeds)
    assert "stop" in {c.finish_reason for c in batched} and len({len(c.token_ids) for c in batched}) > 1
    alone = [_outputs(eng, [p], s, [seed])[0] for p, seed in zip(MIXED, seeds)]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in MIXED]
    _check_paths("stop strings", model, prompts, s, seeds, {"batched": batched, "alone": alone}, float64_copy(model))
    for c in batched + alone:
        if c.finish_reason == "stop":
            assert c.text.endswith(STOPS) and not any(x in c.text[:-1] for x in STOPS)


def test_compaction_threshold_depends_on_the_step_size():
    from fastgrpo.rollout.torch_engine import _compact_at

    assert _compact_at(64) == 16 and _compact_at(3) == 1        # small steps: a quarter of the batch
    assert _compact_at(64, small_step=False) == 1              # large steps: at every finish
