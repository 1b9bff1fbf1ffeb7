"""Multi-turn episodes, correct by test (issue 33, "Tests no peer ships"): the ids trained with mask 1
are the ids the engine sampled, bit for bit (packed and unpacked, a BPE whose decode → encode is
not the identity, a template that strips history); the behaviour log-probs are the trainer's at
the same weights; the mask holds in every loss backend; each stop reason has its mask and reward."""
import numpy as np
import pytest
import torch

from episode_kit import (STRIP_TEMPLATE, ScriptedEngine, bpe_tokenizer, logits_perturbed, sampled_of, tiny_model_for,
                         trained_ids)
from fastgrpo.tasks.base import Problem, Task

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


class ToolTask(Task):
    name = "tooltask"

    def __init__(self, tok, n=2):
        probs = [Problem(i, tok.apply_chat_template([{"role": "user", "content": f"What is 12*34? ({i})"}],
                                                    tokenize=False, add_generation_prompt=True), "408", row={"i": i})
                 for i in range(n)]
        super().__init__(probs, probs[:1])

    def reward_fns(self, pool=None):
        return {"accuracy": lambda completions, answers: [float(a in c) for c, a in zip(completions, answers)]}


def _trainer(tmp_path, tok, script, *extra, cap=0):
    from trainer_helpers import tiny_cfg

    from fastgrpo.trainer.grpo import Trainer

    cfg = tiny_cfg(tmp_path, "rollout.tools=[calculator]", "rollout.max_turns=3", "rollout.max_new_tokens=400",
                   "rewards.functions=[accuracy]", "rewards.weights=[1.0]", "rollout.group_size=2", *extra)
    engine = ScriptedEngine(tok, script, cap_override=cap)
    return Trainer(cfg, tiny_model_for(tok), tok, ToolTask(tok), engine=engine, log=lambda m: None), engine


def _two_calls_then_answer(text, turn):
    return (CALL, False) if turn < 3 else ("The answer is 408.", True)


def _rollout_and_pack(trainer):
    probs = trainer.task.train
    groups = trainer._rollout(probs)
    adv = np.ones((len(probs), trainer.cfg.rollout.group_size), dtype=np.float32)
    return probs, groups, trainer._pack(probs, groups, adv, np.ones(len(probs), dtype=bool))


@pytest.mark.parametrize("budget, share", [(4096, True), (4096, False), (8, False)])
def test_trained_ids_are_the_sampled_ids_bit_for_bit(tmp_path, budget, share):
    """(a) token identity, packed (one micro-batch; a group's prompt carried once, or not) and
    unpacked (packing.max_tokens=8: one sequence a micro-batch); the BPE re-encodes the sampled
    split differently (checked), the trainer trains the split itself; the environment ids are the
    template's rendering."""
    tok = bpe_tokenizer()
    trainer, engine = _trainer(tmp_path, tok, _two_calls_then_answer, f"packing.max_tokens={budget}",
                               f"packing.share_prefix={str(share).lower()}")
    try:
        probs, groups, batches = _rollout_and_pack(trainer)
    finally:
        trainer.close()
    got = trained_ids(batches)
    assert len(got) == 4 and (budget > 100) == (sum(b is not None for b in batches) == 1)
    assert all((b.segment_prefix is not None) == share for b in batches if b is not None)
    calls = [(tuple(ctx), tuple(ids)) for ctx, ids in engine.calls]
    for p, grp in zip(probs, groups):
        for j, c in enumerate(grp):
            led = c.episode
            assert led.stop == "done" and led.turns == 3 and led.tool_calls == 2
            sampled = sampled_of(led)
            for k, seg in enumerate(led.segments):  # each sampled segment: what the engine returned for that context
                if seg.kind == "sampled":
                    assert (tuple(led.ids()[:sum(len(s.ids) for s in led.segments[:k])]), tuple(seg.ids)) in calls
            trained, everything = got[(p.id, j)]
            assert trained == sampled, "the trainer trains exactly the sampled ids"
            assert everything == c.token_ids and trainer._prompt_ids[p.id] + c.token_ids == led.ids()
            assert tok(tok.decode(sampled), add_special_tokens=False)["input_ids"] != sampled  # re-encoding differs
            envs = [s for s in led.segments if s.kind == "environment"]
            assert all("<tool_response>\n408\n</tool_response>" in s.text for s in envs) and len(envs) == 2
            assert c.text == "The answer is 408."  # the final turn is what the rewards score


def test_mask_holds_in_every_loss_backend(tmp_path):
    """(c) changing the logits at environment and bridge tokens changes neither the loss nor the
    gradient, in the reference, torch-stream and Triton (interpreted) backends, and in the chunked
    lm_head path (hidden states of those tokens); the TRL drop-in's tool_mask: test_trl_objective."""
    from fastgrpo.loss import grpo_loss

    tok = bpe_tokenizer()
    trainer, _ = _trainer(tmp_path, tok, _two_calls_then_answer)
    try:
        _, _, batches = _rollout_and_pack(trainer)
    finally:
        trainer.close()
    b = batches[0]
    off = (b.loss_mask == 0).nonzero().flatten()
    assert off.numel() > 20  # environment + bridge ids are in the completion space
    torch.manual_seed(0)
    logits = torch.randn(b.targets.numel(), len(tok), dtype=torch.float64)
    cfg = trainer.loss_cfg
    for impl in ("reference", "torch", "triton"):
        outs = []
        for z in (logits, logits_perturbed(logits, off)):
            z = z.float().clone().requires_grad_(True) if impl != "reference" else z.clone().requires_grad_(True)
            out = grpo_loss(z, b.targets, b.advantages, mask=b.loss_mask, cu_seqlens=b.loss_cu_seqlens, config=cfg,
                            impl=impl)
            out.loss.backward()
            outs.append((out.loss.detach(), z.grad.detach()))
        (l0, g0), (l1, g1) = outs
        assert torch.equal(l0, l1), impl
        assert torch.equal(g0, g1) and not g0[off].any(), impl
    # the chunked lm_head path (hidden states → loss, never [N, V]): hidden rows of environment tokens
    from fastgrpo.loss import fused_linear_grpo_loss

    hidden, weight = torch.randn(b.targets.numel(), 16), torch.randn(len(tok), 16)
    for impl in ("torch", "triton"):
        outs = []
        for h in (hidden, logits_perturbed(hidden, off)):
            h, w = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            out = fused_linear_grpo_loss(h, w, b.targets, b.advantages, mask=b.loss_mask, cu_seqlens=b.loss_cu_seqlens,
                                         config=cfg, chunk_size=7, impl=impl)
            out.loss.backward()
            outs.append((out.loss.detach(), h.grad.detach(), w.grad.detach()))
        (l0, h0, w0), (l1, h1, w1) = outs
        assert torch.equal(l0, l1) and torch.equal(h0, h1) and torch.equal(w0, w1), impl
        assert not h0[off].any(), impl


def test_behaviour_logprobs_equal_the_trainers_on_the_builtin_engine(tmp_path):
    """(b) log-prob parity on the real built-in engine: an environment that always answers makes
    every episode multi-turn; each sampled id's behaviour log-prob equals the trainer's log-prob
    of it at the same weights (float32, the packed forward) within 1e-4."""
    from trainer_helpers import tiny_cfg

    from fastgrpo.rollout.torch_engine import TorchEngine
    from fastgrpo.trainer.grpo import Trainer

    env = tmp_path / "talk_env.py"
    env.write_text("class Env:\n    def reset(self, row):\n        self.n = 0\n"
                   "    def step(self, text):\n        self.n += 1\n        return ('go on %d' % self.n, 0.25, False)\n")
    tok = bpe_tokenizer()
    model = tiny_model_for(tok, seed=3)
    # stop strings a random model meets within a few tokens: turns end before the budget does
    cfg = tiny_cfg(tmp_path, f"rollout.env={env}:Env", "rollout.max_turns=3", "rollout.max_new_tokens=60",
                   "rewards.functions=[env]", "rewards.weights=[1.0]", "rollout.group_size=2", "rollout.stop=[e, a, o]")
    trainer = Trainer(cfg, model, tok, ToolTask(tok), engine=TorchEngine(model, tok), log=lambda m: None)
    try:
        probs, groups, batches = _rollout_and_pack(trainer)
        assert any(c.episode.turns >= 2 for g in groups for c in g)
        got = trained_ids(batches)
        logp = torch.cat([trainer._logprobs_of(trainer.backend.module, b) for b in batches if b is not None])
    finally:
        trainer.close()
    mask = torch.cat([b.loss_mask for b in batches if b is not None]) > 0
    behav = torch.tensor([lp for p, g in zip(probs, groups) for c in g for lp, m in zip(c.logprobs, c.sampled_mask)
                          if m])
    assert [i for p, g in zip(probs, groups) for j, c in enumerate(g) for i in got[(p.id, j)][0]] == \
        [i for g in groups for c in g for i in sampled_of(c.episode)]
    assert torch.allclose(logp[mask], behav, atol=1e-4), (logp[mask] - behav).abs().max()


def test_a_template_that_rewrites_history_takes_its_documented_path(tmp_path):
    """(d) Qwen3-style <think> stripping: refused with history=auto (one line naming the field);
    keep trains the ledger as sampled; fork starts a new sample prompted with the template's
    rendering, and the engine was prompted with exactly that."""
    from fastgrpo.trainer.build import load_episode_parts

    tok = bpe_tokenizer(STRIP_TEMPLATE)

    def think_then_call(text, turn):
        return ("<think>\nI should compute it.\n</think>\n\n" + CALL, False) if turn < 2 else ("408", True)

    from trainer_helpers import tiny_cfg

    with pytest.raises(ValueError, match=r"rollout.history=auto: the chat template rewrites earlier assistant turns"):
        load_episode_parts(tiny_cfg(tmp_path, "rollout.tools=[calculator]", "rollout.max_new_tokens=400").rollout, tok)
    for mode in ("keep", "fork"):
        trainer, engine = _trainer(tmp_path / mode, tok, think_then_call, f"rollout.history={mode}")
        try:
            probs, groups, batches = _rollout_and_pack(trainer)
        finally:
            trainer.close()
        got = trained_ids(batches)
        for p, grp in zip(probs, groups):
            for j, c in enumerate(grp):
                parts = [c] + list(c.forks)
                assert len(parts) == 1  # tool results are not user turns: nothing stripped, nothing forked
                assert got[(p.id, j)][0] == sampled_of(c.episode)


def test_fork_starts_a_new_sample_where_the_template_rewrites(tmp_path):
    """(d) fork, where it bites: an environment answering as the user makes the template strip the
    first turn's <think>; the second turn is a sample of its own whose prompt is the template's
    rendering (what the engine was given), both samples' mask-1 ids are exactly what was sampled."""
    from trainer_helpers import tiny_cfg

    from fastgrpo.trainer.grpo import Trainer

    env = tmp_path / "user_env.py"
    env.write_text("class Env:\n    def reset(self, row):\n        self.n = 0\n"
                   "    def step(self, text):\n        self.n += 1\n        return ('try again', None, self.n >= 2)\n")
    tok = bpe_tokenizer(STRIP_TEMPLATE)

    def script(text, turn):
        return ("<think>\nhmm\n</think>\n\n99", True) if turn < 2 else ("408", True)

    cfg = tiny_cfg(tmp_path, f"rollout.env={env}:Env", "rollout.max_turns=3", "rollout.max_new_tokens=200",
                   "rewards.functions=[accuracy]", "rewards.weights=[1.0]", "rollout.group_size=2",
                   "rollout.history=fork")
    engine = ScriptedEngine(tok, script)
    trainer = Trainer(cfg, tiny_model_for(tok), tok, ToolTask(tok), engine=engine, log=lambda m: None)
    try:
        probs, groups, batches = _rollout_and_pack(trainer)
    finally:
        trainer.close()
    got = trained_ids(batches)
    G = 2
    for p, grp in zip(probs, groups):
        for j, c in enumerate(grp):
            assert c.episode.stop == "done" and len(c.forks) == 1
            fork = c.forks[0]
            text = tok.decode(fork.prompt_ids)
            assert "<think>" not in text.split("<|im_start|>assistant")[1]  # the template's history: stripped
            assert any(ctx == fork.prompt_ids for ctx, _ in engine.calls)  # the engine saw that prompt
            assert got[(p.id, j)][0] == [i for i, m in zip(c.token_ids, c.sampled_mask) if m]
            assert got[(p.id, j + G)][0] == [i for i, m in zip(fork.token_ids, fork.sampled_mask) if m]
            assert tok.decode(got[(p.id, j + G)][0], skip_special_tokens=True) == "408"


def _reason_env(tmp_path, body):
    path = tmp_path / "reason_env.py"
    path.write_text("import time\nclass Env:\n    def reset(self, row):\n        return None\n"
                    f"    def step(self, text):\n{body}\n")
    return f"{path}:Env"


@pytest.mark.parametrize("reason", ["done", "max_turns", "budget", "length", "tool_timeout", "tool_error",
                                    "parse_error"])
def test_each_stop_reason_with_its_mask_and_reward(tmp_path, reason):
    """(e) the truncation table: every stop reason ends the episode where README says, every sampled
    id (a truncated turn's too) has mask 1 and nothing else has, the reward is the final turn's."""
    tok = bpe_tokenizer()
    extra, cap = [], 0
    script = _two_calls_then_answer
    if reason == "max_turns":
        extra = ["rollout.max_turns=2"]
    elif reason == "budget":
        extra = ["rollout.max_new_tokens=200"]
    elif reason == "length":
        cap = 40  # the engine's own cap (its context) cuts the first turn
    elif reason == "parse_error":
        script = lambda text, turn: ('<tool_call>{"name": calculator}</tool_call>', False)  # noqa: E731
        extra = ["rollout.tool_errors=stop"]
    elif reason in ("tool_timeout", "tool_error"):
        body = "        time.sleep(60)" if reason == "tool_timeout" else "        raise RuntimeError('broken env')"
        extra = [f"rollout.env={_reason_env(tmp_path, body)}", "rollout.tool_timeout=1"]
    trainer, engine = _trainer(tmp_path, tok, script, *extra, cap=cap)
    try:
        probs, groups, batches = _rollout_and_pack(trainer)
        per_fn, total, _ = trainer._score(probs, groups)
    finally:
        trainer.close()
    got = trained_ids(batches)
    turns = {"done": 3, "max_turns": 2, "budget": None, "length": 1, "tool_timeout": 1, "tool_error": 1,
             "parse_error": 1}[reason]
    for p, grp in zip(probs, groups):
        for j, c in enumerate(grp):
            led = c.episode
            assert led.stop == reason, (led.stop, [(s.kind, s.text) for s in led.segments])
            if turns is not None:
                assert led.turns == turns
            assert got[(p.id, j)][0] == sampled_of(led)
            assert c.sampled_mask == [1 if s.kind == "sampled" else 0 for s in led.segments[1:] for _ in s.ids][
                :len(c.sampled_mask)]
            assert len(c.token_ids) <= trainer.cfg.rollout.max_new_tokens
    assert total.tolist() == [[1.0, 1.0]] * 2 if reason == "done" else total.max() == 0.0


def test_bad_episode_config_is_refused_at_load(tmp_path):
    """One line naming the field, before any model starts."""
    from trainer_helpers import tiny_cfg

    from fastgrpo.config import load_config
    from fastgrpo.trainer.build import load_episode_parts

    tok = bpe_tokenizer()
    (tmp_path / "untyped.py").write_text("def add(a, b):\n    '''Add.'''\n    return a + b\n")
    (tmp_path / "noreset.py").write_text("class Env:\n    def step(self, text):\n        return ('', None, True)\n")
    cases = [("rollout.tools=[nosuchmodule_xyz:f]", r"rollout.tools.*does not import"),
             (f"rollout.tools=[{tmp_path}/untyped.py:add]", r"rollout.tools.*type hint"),
             (f"rollout.env={tmp_path}/noreset.py:Env", r"rollout.env.*reset"),
             ("rollout.tools=[calculator]|rollout.max_new_tokens=12", r"rollout.max_new_tokens=12: the episode budget")]
    for overrides, pattern in cases:
        cfg = tiny_cfg(tmp_path, *overrides.split("|"))
        with pytest.raises(ValueError, match=pattern):
            load_episode_parts(cfg.rollout, tok)
    with pytest.raises(ValueError, match=r"rollout.max_turns=0"):
        load_config(None, ["rollout.max_turns=0"])
    with pytest.raises(ValueError, match=r"rollout.turn_rewards='?dense'?.*unless rollout.env is set"):
        load_config(None, ["rollout.tools=[calculator]", "rollout.turn_rewards=dense"])
    with pytest.raises(ValueError, match=r"rollout.turn_rewards"):
        load_config(None, ["rollout.turn_rewards=per_token"])


def test_a_step_reports_episode_metrics_and_samples_turn_by_turn(tmp_path):
    """Metrics per step (episode/turns_mean, tool_calls, tool_errors, tool_timeouts, stop_<reason>)
    and samples.jsonl rows that show each episode turn by turn (sampled vs environment text)."""
    import json

    tok = bpe_tokenizer()

    def one_bad_call(text, turn):  # a call of a tool that does not exist, then the answer
        return ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', False) if turn < 2 else ("408", True)

    trainer, _ = _trainer(tmp_path, tok, one_bad_call, "logging.samples_every=1", "steps=1")
    try:
        logs = trainer.step()
        from fastgrpo.trainer.evaluation import evaluate

        ev = evaluate(trainer.engine, trainer.task.heldout, trainer.reward_fns, trainer.cfg.eval, trainer.cfg.rollout)
    finally:
        trainer.close()
    # held-out episodes run their tools too, and say how they used them; eval_samples rows show each turn
    assert ev["eval/episode/tool_calls"] == 1.0 and ev["eval/episode/tool_errors"] == 1.0
    assert ev["eval/episode/stop_done"] == 1.0 and ev["eval/accuracy"] == 1.0
    assert [t["kind"] for t in ev.samples[0]["episode"]] == ["sampled", "bridge", "environment", "bridge", "sampled"]
    assert logs["episode/turns_mean"] == 2.0 and logs["episode/tool_calls"] == 1.0
    assert logs["episode/tool_errors"] == 1.0 and logs["episode/tool_timeouts"] == 0.0
    assert logs["episode/stop_done"] == 1.0 and logs["episode/stop_budget"] == 0.0
    assert logs["episode/tool_leaks"] == 0.0
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows and all(r["stop"] == "done" and r["turns"] == 2 for r in rows)
    kinds = [t["kind"] for t in rows[0]["episode"]]
    assert kinds == ["sampled", "bridge", "environment", "bridge", "sampled"], kinds
    env = [t["text"] for t in rows[0]["episode"] if t["kind"] == "environment"][0]
    assert "unknown tool" in env.lower() or "nope" in env  # the error went back to the model as text


TURN_ENV = ("class Env:\n    def reset(self, row):\n        self.n = 0\n"
            "    def step(self, text):\n        self.n += 1\n"
            "        reward = None if self.n == 2 else float(text.count('good'))\n"
            "        return ('go on', reward, self.n >= 3)\n")


@pytest.mark.parametrize("mode", ["outcome", "dense"])
def test_per_turn_rewards_reach_the_tokens_of_their_turns(tmp_path, mode):
    """rollout.turn_rewards=dense: an environment's per-turn rewards (turns 1 and 3; turn 2 gives
    none) go through the per-token advantage path: every sampled id of turn 1 carries turn 1's
    advantage plus turn 3's (credit to go), turns 2 and 3 turn 3's, environment ids 0, each reward
    normalised over its group; the packed batch carries outcome + that on every id. outcome: no
    per-token term, the `env` reward is their sum."""
    import itertools

    from fastgrpo.advantages import step_advantages

    (tmp_path / "turn_env.py").write_text(TURN_ENV)
    said = itertools.count()

    def script(text, turn):  # every call says something else: the group's turn rewards differ
        k = next(said)
        return ("good " * (k % 3) + "answer 408", True)

    trainer, _ = _trainer(tmp_path, bpe_tokenizer(), script, "rollout.tools=[]",
                          f"rollout.env={tmp_path / 'turn_env.py'}:Env", f"rollout.turn_rewards={mode}",
                          "rollout.turn_reward_weight=0.5", "rewards.functions=[env]", "rewards.weights=[1.0]")
    try:
        probs = trainer.task.train
        groups = trainer._rollout(probs)
        per_fn, total, dropped = trainer._score(probs, groups)
        _, adv, keep, _ = trainer._advantages(probs, per_fn, total, dropped)
        batches = trainer._pack(probs, groups, adv, keep)
    finally:
        trainer.close()
    comps = [c for g in groups for c in g]
    rewards = [[r for _, r in c.episode.turn_rewards] for c in comps]
    assert all(len(r) == 2 for r in rewards) and len({tuple(r) for r in rewards}) > 1, rewards
    assert total.reshape(-1).tolist() == [sum(r) for r in rewards]  # the env reward: their sum
    from fastgrpo.trainer.step_metrics import episode_metrics

    m = episode_metrics(groups)
    flat = [x for r in rewards for x in r]
    assert m["episode/turn_rewards"] == 2.0 and m["episode/turn_reward_mean"] == pytest.approx(sum(flat) / len(flat))
    if mode == "outcome":
        assert all(getattr(c, "step_advantages", None) is None for c in comps)
        return
    want = step_advantages(rewards, 2, credit="to_go")
    assert any(a is not None and np.abs(a).max() > 0.1 for a in want), want  # a signal to find
    trained = {}
    for c, a in zip(comps, want):
        got = c.step_advantages
        assert got.shape == (len(c.token_ids),)
        pos, turn = 0, 0
        for s in c.episode.segments[1:]:
            seg = got[pos:pos + len(s.ids)]
            if s.kind == "sampled":
                turn += 1
                expect = 0.5 * (a[0] if turn == 1 else a[1])  # turn 2 has no reward: it takes turn 3's
                assert np.allclose(seg, expect, atol=1e-6), (turn, seg, expect)
            else:
                assert not seg.any(), s.kind
            pos += len(s.ids)
        assert turn == 3
    for i, (p, grp) in enumerate(zip(probs, groups)):
        for j, c in enumerate(grp):
            trained[(p.id, j)] = float(adv[i, j]) + c.step_advantages
    for b in batches:
        if b is None:
            continue
        lo = b.loss_cu_seqlens.tolist()
        for s, key in enumerate(b.ids):
            m = b.loss_mask[lo[s]:lo[s + 1]] > 0
            expect = torch.as_tensor(trained[tuple(key)], dtype=torch.float32)
            assert expect.shape == m.shape
            assert torch.allclose(b.advantages[lo[s]:lo[s + 1]][m], expect[m], atol=1e-6)


class _CanonicalEngine(ScriptedEngine):
    """ScriptedEngine that samples the tokenizer's own split of its text (what SFT teaches)."""

    def _sample(self, prompt_ids, sampling, max_new_tokens, seeds):
        outs = super()._sample(prompt_ids, sampling, max_new_tokens, seeds)
        for o in outs:
            eos = o.token_ids[-1:] == [self.tokenizer.eos_token_id]
            o.token_ids[:] = self.tokenizer(o.text, add_special_tokens=False)["input_ids"] + (
                [self.tokenizer.eos_token_id] if eos else [])
            o.logprobs[:] = [-0.01] * len(o.token_ids)
        return outs


@pytest.mark.parametrize("column", ["completion", "messages"])
def test_an_sft_tool_trace_is_the_episode_the_runner_builds(tmp_path, column):
    """A tool trace given as data (a `completion` message list, or a chat row's turns after its
    user message) becomes SFT ids and a loss mask that equal, token for token, the ledger of the
    episode in which the model writes those turns: the call stops at </tool_call> (the close after
    it not trained), the tool's answer and the next header as the runner renders them (not
    trained), the final turn and its eos trained."""
    import json

    from fastgrpo.config import DataConfig
    from fastgrpo.tasks.build import build_task
    from fastgrpo.trainer.sft import _encode_completion, sft_examples

    tok = bpe_tokenizer()
    trace = [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "408"},
             {"role": "assistant", "content": "The answer is 408."}]
    q = "What is 12*34? (0)"
    row = ({"prompt": q, "completion": trace} if column == "completion"
           else {"messages": [{"role": "user", "content": q}] + trace})
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(dict(row, answer="408")) + "\n")
    task = build_task(DataConfig(path=str(path)), tokenizer=tok)
    p = task.train[0]
    ((_, segments),) = sft_examples(task, [p], None, 0.0, tok)
    ids, mask = _encode_completion(tok, segments, tok.eos_token_id)

    trainer, engine = _trainer(tmp_path, tok, lambda text, turn: (CALL, False) if turn < 2 else
                               ("The answer is 408.", True), "rollout.max_turns=2")
    engine.__class__ = _CanonicalEngine
    try:
        prob = trainer.task.train[0]
        assert prob.prompt == p.prompt  # the same rendered prompt
        led = trainer._rollout([prob])[0][0].episode
    finally:
        trainer.close()
    assert led.stop == "done" and led.tool_calls == 1
    full = led.ids()
    n = len(trainer._prompt_ids[prob.id])
    episode_mask = [1.0 if s.kind == "sampled" else 0.0 for s in led.segments for _ in s.ids][n:]
    assert ids == full[n:] and mask == episode_mask
    assert sum(mask) == len(tok(CALL, add_special_tokens=False)["input_ids"]) + \
        len(tok("The answer is 408.", add_special_tokens=False)["input_ids"]) + 1   # the two turns and the eos
