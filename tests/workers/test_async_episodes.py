"""Multi-turn episodes under rollout.mode=async (issue 33, items 3a and 5): the rollout workers run
the episodes (their environment in the worker's own processes), weights may load between two
turns (rollout.inflight=keep), every sampled token keeps the version that sampled it, staleness is
counted from an episode's oldest token, and the trainer trains exactly the ids the worker sampled."""
import os
import sys

from async_helpers import async_cfg
from trainer_helpers import NoisyTask

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "rollout"))

from episode_kit import trained_ids  # noqa: E402  (the episode tests' view of a packed batch)

from fastgrpo.episodes.ledger import Ledger  # noqa: E402

ENV = "class Env:\n    def reset(self, row):\n        self.n = 0\n" \
      "    def step(self, text):\n        self.n += 1\n        return ('ok', None, self.n >= 3)\n"


def test_async_workers_train_exactly_the_sampled_ids_of_multi_turn_episodes(ray_local, tmp_path):
    from trainer_helpers import TINY  # noqa: F401  (async_cfg's base)

    from fastgrpo.trainer.async_trainer import AsyncTrainer
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.grpo import seed_everything

    env = tmp_path / "answer_env.py"
    env.write_text(ENV)
    cfg = async_cfg(tmp_path, f"rollout.env={env}:Env", "rollout.max_turns=3", "rollout.max_new_tokens=30",
                    'rollout.stop=["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"]', "rollout.max_staleness=1",
                    "rollout.inflight=keep", "rollout.prompts_per_call=1", "steps=3")
    seed_everything(cfg.seed)
    model, tok = build_model(cfg.model)
    tr = AsyncTrainer(cfg, model, tok, NoisyTask(), log=lambda m: None)
    seen = []
    pack = tr._pack

    def recording(problems, groups, adv, keep):
        batches = pack(problems, groups, adv, keep)
        seen.append((problems, groups, batches))
        return batches

    tr._pack = recording
    try:
        logs = [tr.step() for _ in range(cfg.steps)]
    finally:
        tr.close()
    assert max(m["async/staleness_max"] for m in logs) <= 1
    assert max(m["episode/turns_mean"] for m in logs) > 1.0
    n = n_trained = 0
    for problems, groups, batches in seen:
        trained = {key: ids for key, (ids, _) in trained_ids(batches).items()}
        for p, g in zip(problems, groups):
            for j, c in enumerate(g):
                led = c.episode
                assert isinstance(led, Ledger) and led.stop in ("done", "max_turns", "budget")
                sampled = [i for s in led.segments if s.kind == "sampled" for i in s.ids]
                if (p.id, j) in trained:  # a group of σ = 0 is not trained (algorithm.drop_zero_std)
                    assert trained[(p.id, j)] == sampled
                    n_trained += 1
                vs = c.token_versions
                assert vs is not None and len(vs) == len(c.token_ids) and vs == sorted(vs)
                assert all(len(s.versions) == len(s.ids) for s in led.segments if s.kind == "sampled")
                assert c.policy_version == min(vs)  # staleness counts from the oldest token
                n += 1
    assert n == cfg.steps * cfg.rollout.prompts_per_step * cfg.rollout.group_size and n_trained >= 8
