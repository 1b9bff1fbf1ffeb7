"""The built-in engine's continuous turn batcher (fastgrpo.rollout.continuous.TurnBatcher) on its
own, against the float64 oracle (rollout_oracle):

- turns admitted into a running batch, a layout that runs out of slots every two steps (laid out
  again), finished rows compacted away, and second turns on each episode's kept cache: every
  token is the inverse-CDF draw of its seed's uniform and every log-prob the float64 model's;
- weights that change mid-turn: `weights_changed("keep")` keeps the running rows' keys / values,
  "abort" re-prefills them, and every token carries the version that sampled it (check_swap tells
  the two apart);
- an engine that cannot batch continuously is refused up front when asked to."""
import pytest

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import SamplingConfig, continuous
from fastgrpo.rollout.continuous import TurnBatcher
from fastgrpo.rollout.episodes import EpisodeRunner, EpisodeSettings
from fastgrpo.rollout.torch_engine import TorchEngine
from rollout_oracle import check_rollouts, check_swap
from test_inflight_swap import swap_models

pytestmark = pytest.mark.usefixtures("one_thread")

CAP = 12


def _drain(b, done, at=None, then=None):
    """Step `b` until idle; `then()` after step number `at`. Returns the steps taken."""
    n = 0
    while b.busy:
        done.extend(b.step())
        n += 1
        if n == at:
            then()
    return n


@pytest.mark.parametrize("budget", ["ample", "two", "none"])
def test_admission_into_a_running_batch_slot_growth_and_kept_caches(monkeypatch, budget):
    """budget: the kept caches' memory budget — every cache kept, about two (the longest-kept
    evicted first), none (every later turn prefills its whole context)."""
    monkeypatch.setattr(continuous, "_SLOTS_AHEAD", 2)   # the layout runs out of slots every other step
    monkeypatch.setattr(continuous, "_ADMIT_WAIT", 1)    # a late turn joins the running batch at once
    model, tok = build_tiny_model("qwen2", seed=5, head_dim=32, num_attention_heads=2)
    eng = TorchEngine(model, tok, copy_model=True, num_threads=1)
    assert TurnBatcher.supports(eng)
    c = model.config
    per_id = c.num_hidden_layers * 2 * c.num_key_value_heads * 32 * 4  # bytes of one kept id (float32)
    cache_bytes = {"ample": 1 << 40, "two": 2 * 14 * per_id, "none": 0}[budget]
    stops = tuple(range(3, model.config.vocab_size, 5))  # a fifth of the vocabulary ends a turn: uneven lengths
    b = TurnBatcher(eng, SamplingConfig(temperature=1.0, max_new_tokens=CAP, stop_token_ids=stops),
                    cache_bytes=cache_bytes)
    prompts = {0: [5, 9, 13, 2, 7], 1: [5, 9, 13, 2, 7], 2: [3, 4], 3: [11, 12, 13, 14, 15, 16, 17], 4: [8, 6]}
    seeds = {k: 100 + k for k in prompts}
    contexts, done = {}, []
    for k in (0, 1, 2):
        contexts[k] = prompts[k]
        b.submit(k, prompts[k], CAP, seeds[k])

    def late():
        for k in (3, 4):
            contexts[k] = prompts[k]
            b.submit(k, prompts[k], CAP, seeds[k])

    _drain(b, done, at=2, then=late)
    first = dict(done)
    assert sorted(first) == [0, 1, 2, 3, 4] and b.stats["admissions"] >= 3, b.stats
    # second turns: each episode's context grows by its turn and an environment's answer; episode 4
    # ended in between (its cache is forgotten, its next turn prefills everything)
    done.clear()
    for k, c in first.items():
        contexts[10 + k] = contexts[k] + c.token_ids + [21, 22, 23]
        seeds[10 + k] = 200 + k
    b.forget(4)
    kept = set(b.saved)
    assert b.saved_bytes == sum(per_id * len(b.saved[k][0]) for k in kept) <= cache_bytes
    assert {"ample": kept == {0, 1, 2, 3}, "two": 0 < len(kept) < 4 and b.stats["evicted"] > 0,
            "none": not kept}[budget], (kept, b.stats)
    reused0, prefill0 = b.stats["reused_ids"], b.stats["prefill_ids"]
    for k in first:
        b.submit(k, contexts[10 + k], CAP, seeds[10 + k])
    _drain(b, done)
    second = {10 + k: c for k, c in done}
    reused = b.stats["reused_ids"] - reused0
    fed = {k: len(contexts[k]) + len(first[k].token_ids) - 1 for k in kept}  # ids each kept cache holds
    assert reused == sum(fed.values()), (reused, fed)
    assert b.stats["prefill_ids"] - prefill0 == sum(len(contexts[10 + k]) - 1 - fed.get(k, 0) for k in first)
    keys = sorted(first) + sorted(second)
    outs = {**first, **second}
    check_rollouts("turn batcher", model, [contexts[k] for k in keys], [outs[k] for k in keys], temperature=1.0,
                   seeds=[seeds[k] for k in keys], budget=CAP)
    assert (bool(b.saved) == (budget != "none")) and not b.busy
    b.close()


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_weights_that_change_mid_turn(mode):
    a, new, tok = swap_models(seed=2)
    eng = TorchEngine(a, tok, copy_model=True, num_threads=1)
    version = [0]
    b = TurnBatcher(eng, SamplingConfig(temperature=1.0, max_new_tokens=10), version=lambda: version[0])
    prompts = [[5, 9, 13, 2, 7], [3, 4], [11, 12, 13, 14, 15, 16, 17]]
    for i, p in enumerate(prompts):
        for j in range(2):
            b.submit((i, j), p, 10, 7 + 2 * i + j)

    def swap():
        eng.update_weights(new)
        version[0] = 1
        b.weights_changed(mode)

    done = []
    _drain(b, done, at=4, then=swap)  # tokens 0..3 sampled by version 0
    got = dict(done)
    groups = [[got[(i, j)] for j in range(2)] for i in range(len(prompts))]
    assert max(len(c.token_ids) for g in groups for c in g) > 4
    check_swap(f"turn batcher/{mode}", a, new, prompts, groups, mode, 4)
    # keep: the running batch stays as it was laid out; abort: it is prefilled again (prompt + 4 tokens)
    assert b.stats["admissions"] == (1 if mode == "keep" else 2), b.stats
    # identical contexts are prefilled once: the prompts at the start, the re-prefilled rows at abort
    again = {tuple(p + c.token_ids[:4]) for p, g in zip(prompts, groups) for c in g}
    assert b.stats["prefill_ids"] == sum(len(p) - 1 for p in prompts) + \
        (0 if mode == "keep" else sum(len(x) - 1 for x in again)), b.stats

def test_continuous_batching_refused_where_the_engine_cannot():
    model, tok = build_tiny_model("qwen2", seed=1, head_dim=32, num_attention_heads=2)
    hf = TorchEngine(model, tok, decoder="hf", num_threads=1)
    assert not TurnBatcher.supports(hf)
    for batching in ("continuous", "sync"):
        with pytest.raises(ValueError, match=f"episode_batching={batching}: the engine cannot batch turns"):
            EpisodeRunner(hf, tok, EpisodeSettings(batching=batching))
    with pytest.raises(ValueError, match="expected auto, continuous, groups or sync"):
        EpisodeRunner(hf, tok, EpisodeSettings(batching="rolling"))
    runner = EpisodeRunner(hf, tok, EpisodeSettings(batching="auto"))  # auto: the grouped loop
    try:
        assert runner._batcher(SamplingConfig()) is None
    finally:
        runner.close()
    lean = TorchEngine(model, tok, decoder="lean", num_threads=1)
    runner = EpisodeRunner(lean, tok, EpisodeSettings(batching="continuous"))
    try:
        assert isinstance(runner._batcher(SamplingConfig()), TurnBatcher)
    finally:
        runner.close()
    with pytest.raises(ValueError, match="empty context"):
        TurnBatcher(lean, SamplingConfig()).submit(0, [], 4, 0)
    with pytest.raises(ValueError, match="cap=0"):
        TurnBatcher(lean, SamplingConfig()).submit(0, [1], 0, 0)


def test_admission_waits_until_a_share_of_the_batch_fits():
    """A full batch (max_batch_size 8) with a long queue: one finished row frees one slot, and
    admitting one turn would re-lay out the whole batch for it; the batch waits until the turns an
    admission can take are half of the running rows (three freed at step 4 here), or until the
    waiting turn has waited _ADMIT_WAIT steps. The admitted turns are still the oracle's."""
    model, tok = build_tiny_model("qwen2", seed=5, head_dim=32, num_attention_heads=2)
    eng = TorchEngine(model, tok, copy_model=True, num_threads=1, max_batch_size=8)
    eng.eos_ids = []  # turns end at their caps only: the finishing steps are fixed
    b = TurnBatcher(eng, SamplingConfig(temperature=1.0, max_new_tokens=CAP))
    caps = [2, 4, 4] + [CAP] * 13           # rows 0..7 run first; 8..15 queue for rows
    prompts = [[5 + i % 7, 9, 13, 2 + i % 3] for i in range(len(caps))]
    for i, (p, cap) in enumerate(zip(prompts, caps)):
        b.submit(i, p, cap, 300 + i)
    admitted, done = [], []
    admit = b._admit

    def spy(room):
        admitted.append((b.stats["steps"], min(room, len(b.queue))))
        admit(room)

    b._admit = spy
    while b.busy:
        done.extend(b.step())
    # step 0: eight rows; row 0 ends at its 2nd step (one slot: no admission), rows 1 and 2 at their
    # 4th (three slots, five running: 3 >= 5 // 2): the admission comes before step 5
    assert admitted[:2] == [(0, 8), (4, 3)], admitted
    got = dict(done)
    assert [len(got[i].token_ids) for i in range(len(caps))] == caps
    check_rollouts("turn batcher/admission share", model, prompts, [got[i] for i in range(len(caps))],
                   temperature=1.0, seeds=[300 + i for i in range(len(caps))], budget=CAP)
    # a single free slot is taken once the waiting turn has waited _ADMIT_WAIT steps
    b2 = TurnBatcher(eng, SamplingConfig(temperature=1.0, max_new_tokens=40))
    for i in range(9):
        b2.submit(i, prompts[i], 2 if i == 0 else 40, 300 + i)
    steps = []
    admit2 = b2._admit
    b2._admit = lambda room: (steps.append(b2.stats["steps"]), admit2(room))
    while len(steps) < 2:
        b2.step()
    assert steps == [0, 2 + continuous._ADMIT_WAIT], steps
    b2.close()


def test_collect_waits_within_a_window_for_answers_due():
    """The continuous loop's idle engine takes every tool answer that arrives within one
    admission's time (`_collect(within=…)`): answered ones are taken, unanswered ones stay."""
    import concurrent.futures

    model, tok = build_tiny_model("qwen2", seed=1, head_dim=32, num_attention_heads=2)
    runner = EpisodeRunner(TorchEngine(model, tok, decoder="lean", num_threads=1), tok, EpisodeSettings())
    try:
        eps = [type("Ep", (), {"index": i})() for i in range(3)]
        futs = [concurrent.futures.Future() for _ in eps]
        futs[0].set_result("a")
        futs[2].set_result("c")
        runner._answered = lambda ep, res: True
        waiting, back = dict(zip(futs, eps)), []
        runner._collect(waiting, back, block=False, within=0.05)  # futs[1] never answers: 50 ms, then on
        assert [ep.index for ep in back] == [0, 2] and list(waiting) == [futs[1]]
        futs[1].set_result("b")
        runner._collect(waiting, back, block=False, within=30.0)  # all answered: no wait
        assert [ep.index for ep in back] == [0, 2, 1] and not waiting
    finally:
        runner.close()
