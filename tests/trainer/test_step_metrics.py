"""A training step's logged loss metrics equal what the loss computed, and a sequence longer
than the packing budget trains in a micro-batch of its own instead of failing the step."""
import torch
from trainer_helpers import NoisyTask

import fastgrpo.loss as loss_mod
from fastgrpo.trainer.grpo import Trainer


def test_logged_entropy_is_the_masked_mean_of_the_loss_entropies(cfg_factory, monkeypatch):
    seen = []
    real = loss_mod.grpo_loss

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.append((out.entropy.detach().double(), kw["mask"].double()))
        return out

    monkeypatch.setattr(loss_mod, "grpo_loss", spy)
    t = Trainer(cfg_factory("steps=1"), task=NoisyTask(), log=lambda m: None)
    logs = t.step()
    t.close()
    assert seen, "the update ran no loss"
    ent = sum(float((e * m).sum()) for e, m in seen) / sum(float(m.sum()) for _, m in seen)
    assert abs(logs["loss/entropy_mean"] - ent) < 1e-4 * max(1.0, ent), (logs["loss/entropy_mean"], ent)


def test_sequence_over_the_packing_budget_gets_its_own_micro_batch(cfg_factory):
    # prompts of ~6 tokens + up to 8 new tokens against a budget of 6: every sequence is oversize
    t = Trainer(cfg_factory("steps=1", "packing.max_tokens=6"), task=NoisyTask(), log=lambda m: None)
    before = {k: v.clone() for k, v in t.backend.module.state_dict().items()}
    logs = t.step()
    t.close()
    assert "train/skipped" not in logs
    changed = any(not torch.equal(v, before[k]) for k, v in t.backend.module.state_dict().items())
    assert changed or logs.get("train/no_update") == 1.0


class _CountingTokenizer:
    """The trainer's tokenizer, recording the texts of each call."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __call__(self, text, **kw):
        self.calls.append(text)
        return self.tok(text, **kw)


def test_pack_tokenizes_new_prompts_once_and_packs_every_kept_rollout(cfg_factory):
    t = Trainer(cfg_factory("steps=1"), task=NoisyTask(), log=lambda m: None)
    tok = t.tokenizer = _CountingTokenizer(t.tokenizer)
    problems = t.curriculum.sample(4)
    problems = problems + problems[:1]  # a prompt twice in one batch
    groups = t._rollout(problems)
    per_fn, total, dropped = t._score(problems, groups)
    _, adv, keep, _ = t._advantages(problems, per_fn, total, dropped)
    keep[:] = True
    keep[1] = False
    batches = t._pack(problems, groups, adv, keep)
    # one call for the unseen prompts (each once), the same ids as one call per prompt
    unique = list(dict.fromkeys(p.id for p in problems))
    by_id = {p.id: p for p in problems}
    assert tok.calls == [[by_id[i].prompt for i in unique]]
    for i in unique:
        assert t._prompt_ids[i] == tok.tok(by_id[i].prompt, add_special_tokens=False)["input_ids"]
    t._pack(problems, groups, adv, keep)
    assert len(tok.calls) == 1  # cached from then on
    kept = [(i, j) for i in range(len(problems)) if keep[i] for j in range(len(groups[i]))]
    seen = set()
    for b in batches:
        n = 0
        for s, k in enumerate(b.seq_index.tolist()):
            i, j = kept[k]
            c = groups[i][j]
            assert b.ids[s] == (problems[i].id, j) and b.prompt_lens[s] == len(t._prompt_ids[problems[i].id])
            m = len(c.token_ids)
            assert b.targets[n:n + m].tolist() == list(c.token_ids)
            assert b.loss_mask[n:n + m].tolist() == [float(x) for x in c.sampled_mask]
            assert b.advantages[n:n + m].tolist() == [float(adv[i, j])] * m
            n += m
            seen.add(k)
    assert seen == set(range(len(kept)))
    t.close()
