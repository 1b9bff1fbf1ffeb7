"""Weights that change in the middle of a generate call (rollout.inflight=keep | abort, the async
rollout workers' in-flight updates) on the built-in engine, every decoder path: the tokens
sampled after the swap carry the new version, and every log-prob is the one of the policy that
really sampled it, checked against float64 —

- abort: the rows are re-prefilled (prompt + tokens so far) under the new weights, so a token
  after the swap is the new model's, teacher-forced;
- keep: the cached keys / values of the tokens before the swap stay (the old model's), the later
  positions run the new weights: the oracle runs the old float64 model over the prefix and the
  new one over the rest on top of its cache.

The two oracles differ by far more than the tolerance (checked), so a keep that re-prefills, an
abort that keeps the old cache, or a swap that never reaches the decode steps fails here."""
import copy

import pytest
import torch

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import SamplingConfig
from fastgrpo.rollout.torch_engine import TorchEngine
from rollout_oracle import check_swap

pytestmark = pytest.mark.usefixtures("one_thread")

SWAP_AT = 3  # the poll after token 3: tokens 0..3 sampled by version 0, the rest by version 1


def swap_models(seed=0, heads=4, kv_heads=2):
    """Two tiny Llamas `a` (the old weights) and `b` (the new ones), far apart."""
    a, tok = build_tiny_model("llama", seed=seed, hidden_size=64, num_attention_heads=heads,
                              num_key_value_heads=kv_heads, intermediate_size=96)
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return a.eval(), b.eval(), tok


class SwapHook:
    """An engine's `inflight` hook that loads `new` into it at poll number `at` (version 0 → 1),
    through the engine's own `update_weights` (in place; a vLLM engine: its real bucketed sync)."""

    def __init__(self, engine, new, mode, at=SWAP_AT):
        self.engine, self.new, self.mode, self.at = engine, new, mode, at
        self.version, self.polls = 0, 0

    def poll(self):
        self.polls += 1
        if self.polls - 1 != self.at:
            return None
        self.engine.update_weights(self.new)
        self.version = 1
        return 1


@pytest.mark.parametrize("decoder", ["auto", "lean", "hf"])
@pytest.mark.parametrize("mode", ["keep", "abort"])
@pytest.mark.parametrize("stops", [False, True])
def test_a_swap_mid_call_samples_from_the_policy_that_tagged_each_token(decoder, mode, stops, monkeypatch):
    """stops: a quarter of the vocabulary ends a completion, so rows finish before the swap, and
    with compaction off they are still in the batch at it (abort re-prefills the live rows only)."""
    if stops:
        from fastgrpo.rollout import torch_engine

        monkeypatch.setattr(torch_engine, "_compact_at", lambda rows, small_step=True: rows + 1)
    a, b, tok = swap_models()
    eng = TorchEngine(a, tok, copy_model=True, decoder=decoder, num_threads=1)
    eng.inflight = hook = SwapHook(eng, b, mode)
    prompts = [[5, 9, 13, 2, 7], [3, 4], [11, 12, 13, 14, 15, 16, 17]]  # unequal: left padding
    stop_ids = tuple(range(3, a.config.vocab_size, 4)) if stops else ()
    groups = eng.generate(prompts, n=4 if stops else 2, sampling=SamplingConfig(
        temperature=1.0, max_new_tokens=10, seed=3, stop_token_ids=stop_ids))
    if stops:  # rows that stopped before the swap and rows that ran past it
        lens = [len(c.token_ids) for g in groups for c in g]
        assert min(lens) <= SWAP_AT < max(lens), lens
    assert hook.version == 1 and hook.polls > SWAP_AT
    check_swap(f"{decoder}/{mode}", a, b, prompts, groups, mode, SWAP_AT + 1)


def test_without_a_swap_every_token_carries_the_calls_version():
    a, b, tok = swap_models(seed=1)
    eng = TorchEngine(a, tok, copy_model=True, num_threads=1)
    eng.inflight = hook = SwapHook(eng, b, "keep", at=10 ** 6)
    hook.version = 4
    (g,) = eng.generate([[5, 6, 7]], n=3, sampling=SamplingConfig(temperature=1.0, max_new_tokens=6, seed=0))
    assert all(c.token_versions == [4] * len(c.token_ids) for c in g)
    eng.inflight = None
    (g,) = eng.generate([[5, 6, 7]], n=2, sampling=SamplingConfig(temperature=1.0, max_new_tokens=6, seed=0))
    assert all(c.token_versions is None for c in g)  # colocated: no per-token versions


def test_a_thinking_budget_continuation_keeps_the_versions_aligned_with_the_tokens():
    a, b, tok = swap_models(seed=2)
    eng = TorchEngine(a, tok, copy_model=True, num_threads=1)
    eng.inflight = SwapHook(eng, b, "abort", at=1)
    s = SamplingConfig(temperature=1.0, max_new_tokens=12, thinking_budget=4, answer_budget=4, seed=5,
                       think_end="\x01", interrupt="\x02")
    (g,) = eng.generate([[5, 6, 7]], n=4, sampling=s)
    for c in g:
        assert len(c.token_versions) == len(c.token_ids)
        assert c.token_versions == sorted(c.token_versions) and set(c.token_versions) <= {0, 1}
