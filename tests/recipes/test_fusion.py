"""Thinking-mode fusion (fastgrpo/recipes/fusion.py) and the thinking-budget sweep
(fastgrpo/recipes/budget_sweep.py): which traces are kept, the mix (ratio, flags, the chat
template's enable_thinking switch), SFT on the mix, the sweep's rows and budgets, `fastgrpo fuse`
end to end, and the errors on bad input."""
import copy
import json
import os
import random

import pytest
import torch

from fastgrpo import cli
from fastgrpo.config import dump_config, load_config
from fastgrpo.demo.default import default_config
from fastgrpo.rollout.base import Completion, RolloutEngine, SamplingConfig
from fastgrpo.tasks.arithmetic import ArithmeticTask
from fastgrpo.recipes import fusion
from fastgrpo.recipes.budget_sweep import budgets, run_sweep
from fastgrpo.runs.checkpoint import is_complete_model_dir, save_model_atomic

_FAST = ["threads=1", "data.num_heldout=40", "eval.max_problems=40", "rollout.interrupt=</think>",
         "fusion.group_size=2", "fusion.max_prompts=48", "fusion.batch_size=32", "fusion.lr=3e-3"]


def _cfg(tmp_path, *extra):
    return default_config(list(_FAST) + list(extra), out_dir=str(tmp_path / "run"))


class ScriptedEngine(RolloutEngine):
    """Returns, for prompt i of a call, the i-th text of its list (one per sample), tokenized."""

    def __init__(self, tokenizer, texts_by_prompt):
        self.tokenizer = tokenizer
        self.texts = texts_by_prompt
        self.calls = {}

    def _sample(self, prompt_ids, sampling, max_new_tokens, seeds):
        out = []
        for ids in prompt_ids:
            prompt = self.tokenizer.decode(ids)
            k = self.calls.get(prompt, 0)
            self.calls[prompt] = k + 1
            text, reason = self.texts[prompt][k % len(self.texts[prompt])]
            toks = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(Completion(token_ids=toks, logprobs=[0.0] * len(toks), finish_reason=reason, text=text))
        return out

    def update_weights(self, model_or_named):
        return None


def test_collect_keeps_only_verified_traces_once(tmp_path):
    from fastgrpo.models.tiny import build_char_tokenizer
    from fastgrpo.rewards.registry import build_rewards

    cfg = _cfg(tmp_path, "fusion.group_size=5")
    task = ArithmeticTask(10, 10, seed=0)
    tok = build_char_tokenizer()
    a, b = task.train[0], task.train[1]
    x, y = ArithmeticTask.operands(a)
    good = f"<think>{y}+{x}</think><answer>{x + y}</answer>"
    texts = {a.prompt: [(good, "stop"), (good, "stop"),  # a duplicate: kept once
                        (f"<think>{y}+{x}</think><answer>{x + y + 1}</answer>", "stop"),  # wrong answer
                        (f"<answer>{x + y}</answer>", "stop"),  # right but no think block: not well formed
                        (good, "length")],  # cut by the cap
             b.prompt: [(f"<think>1</think><answer>-1</answer>", "stop")]}
    rewards = build_rewards(cfg.rewards, task, cfg.rollout.max_new_tokens)
    traces, counts = fusion.collect_traces(ScriptedEngine(tok, texts), tok, [a, b], rewards, cfg)
    assert [(t.problem.id, t.text) for t in traces] == [(a.id, good)]
    assert traces[0].think_tokens == len(tok(good.split("</think>")[0] + "</think>")["input_ids"])
    assert counts == {"rollouts": 10, "accurate": 4, "well_formed": 2, "kept": 1, "prompts": 2}


def test_no_verified_trace_is_a_clear_error(tmp_path):
    from fastgrpo.models.tiny import build_char_tokenizer
    from fastgrpo.rewards.registry import build_rewards

    cfg = _cfg(tmp_path, "fusion.group_size=3")
    task = ArithmeticTask(10, 10, seed=0)
    tok = build_char_tokenizer()
    texts = {p.prompt: [("<think>0</think><answer>-1</answer>", "stop")] for p in task.train[:4]}
    rewards = build_rewards(cfg.rewards, task, cfg.rollout.max_new_tokens)
    with pytest.raises(ValueError, match=r"no verified traces: 0 of 12 rollouts of 4 train prompts reached "
                                         r"fusion.min_accuracy=1.0"):
        fusion.collect_traces(ScriptedEngine(tok, texts), tok, task.train[:4], rewards, cfg)


def _traces(task, tok, n):
    out = []
    for p in task.train[:n]:
        text = task.sft_completion(p, random.Random(0))
        head = text.split("</think>")[0] + "</think>"
        out.append(fusion.Trace(p, text, len(tok(head, add_special_tokens=False)["input_ids"])))
    return out


@pytest.mark.parametrize("ratio, size, n_think", [(0.25, 40, 10), (0.5, 0, 12), (1.0, 9, 9), (0.0, 7, 0)])
def test_mix_ratio_flags_and_targets(tmp_path, ratio, size, n_think):
    from fastgrpo.models.tiny import build_char_tokenizer

    cfg = _cfg(tmp_path, f"fusion.think_ratio={ratio}", f"fusion.mix_size={size}", "fusion.think_flag=' /think'")
    task, tok = ArithmeticTask(10, 10, seed=0), build_char_tokenizer()
    traces = _traces(task, tok, 12)
    sw = fusion.ModeSwitch(tok, cfg.fusion, templated=False)
    rows = fusion.build_mix(traces, sw, cfg)
    assert len(rows) == (size or 24) and sum(r["mode"] == "think" for r in rows) == n_think
    by_prompt = {t.problem.prompt: t for t in traces}
    for r in rows:
        if r["mode"] == "think":
            assert r["prompt"].endswith(" /think")
            t = by_prompt[r["prompt"][: -len(" /think")]]
            assert r["completion"] == t.text  # the model's own trace, unchanged
        else:
            assert r["prompt"].endswith(" /no_think")
            t = by_prompt[r["prompt"][: -len(" /no_think")]]
            assert r["completion"] == "<think></think>" + t.text.split("</think>")[1]


def test_interrupted_thinking_examples(tmp_path):
    from fastgrpo.models.tiny import build_char_tokenizer

    cfg = _cfg(tmp_path, "fusion.think_ratio=1.0", "fusion.interrupted_fraction=1.0", "fusion.mix_size=30")
    task, tok = ArithmeticTask(10, 10, seed=0), build_char_tokenizer()
    traces = _traces(task, tok, 10)
    rows = fusion.build_mix(traces, fusion.ModeSwitch(tok, cfg.fusion, templated=False), cfg, tok)
    by_prompt = {t.problem.prompt: t for t in traces}
    for r in rows:
        t = by_prompt[r["prompt"]]
        head, answer = r["completion"].rsplit("</think>", 1)
        assert answer == t.text.split("</think>")[1]
        assert head.startswith("<think>") and t.text.startswith(head)  # the opener + a prefix of the reasoning
        assert r["completion"].count("</think>") == 1
    heads = {r["completion"].rsplit("</think>", 1)[0] for r in rows}
    assert "<think>" in heads and any(len(h) > len("<think>") for h in heads)  # cut anywhere, nothing to all


# a tiny Qwen3-like template: the hard switch enable_thinking=False closes an empty think block
_SWITCH_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
                    "not enable_thinking %}<think></think>{% endif %}{% endif %}")
_PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _templated_task(tmp_path, template):
    from fastgrpo.config import DataConfig
    from fastgrpo.models.tiny import build_char_tokenizer
    from fastgrpo.tasks.build import build_task

    tok = build_char_tokenizer()
    tok.chat_template = template
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i}+2?", "answer": str(i + 2)}) + "\n" for i in range(6)))
    return tok, build_task(DataConfig(path=str(path), chat_template="on"), tokenizer=tok)


def test_chat_template_thinking_switch(tmp_path):
    cfg = _cfg(tmp_path)
    tok, task = _templated_task(tmp_path, _SWITCH_TEMPLATE)
    p = task.train[0].prompt
    assert p.endswith("?<|end|><|assistant|>")
    sw = fusion.mode_switch(cfg, tok, task)
    assert sw.uses_template_switch and sw.no_think_prefix == ""  # the template writes the empty block itself
    body = p[: -len("<|end|><|assistant|>")]
    assert sw.prompt(p, False) == body + " /no_think<|end|><|assistant|><think></think>"
    assert sw.prompt(p, True) == p  # think_flag "" and the template's thinking prompt
    trace = fusion.Trace(task.train[0], "<think>2+0</think><answer>2</answer>", 5)
    rows = fusion.build_mix([trace], sw, cfg)
    assert {r["mode"]: r["completion"] for r in rows}["no_think"] == "<answer>2</answer>"
    off = fusion.mode_switch(_cfg(tmp_path, "fusion.template_switch=never"), tok, task)
    assert not off.uses_template_switch and off.prompt(p, False) == body + " /no_think<|end|><|assistant|>"
    assert off.no_think_prefix == "<think></think>"


def test_chat_template_without_switch(tmp_path):
    tok, task = _templated_task(tmp_path, _PLAIN_TEMPLATE)
    p = task.train[0].prompt
    sw = fusion.mode_switch(_cfg(tmp_path), tok, task)
    assert not sw.uses_template_switch
    assert sw.prompt(p, False) == p[: -len("<|end|><|assistant|>")] + " /no_think<|end|><|assistant|>"
    with pytest.raises(ValueError, match="fusion.template_switch=always: the tokenizer's chat template does not read "
                                         "enable_thinking"):
        fusion.mode_switch(_cfg(tmp_path, "fusion.template_switch=always"), tok, task)


def test_bad_fusion_config_fails_at_load():
    with pytest.raises(ValueError, match=r"fusion.budget_fractions=\[0.0, 1.5\]: expected .*each in \[0, 1\]"):
        load_config(None, ["fusion.budget_fractions=[0, 1.5]"])
    with pytest.raises(ValueError, match=r"fusion.think_ratio=-0.1"):
        load_config(None, ["fusion.think_ratio=-0.1"])
    with pytest.raises(ValueError, match=r"fusion.no_think_flag=''"):
        load_config(None, ["fusion.template_switch=never", "fusion.no_think_flag="])
    with pytest.raises(ValueError, match=r"-0.5 is not a fraction in \[0, 1\]"):
        budgets([0.0, -0.5], 8)
    assert budgets([0, 0.25, 0.5, 0.75, 1], 7) == [0, 2, 4, 5, 7]


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """A cold-started demo model (thinking only), a copy fused on a mix of its task's traces,
    and what they need: (cfg, task, tok, before, after, reward_fns, traces)."""
    from fastgrpo.models.tiny import build_tiny_model
    from fastgrpo.rewards.registry import build_rewards
    from fastgrpo.trainer.grpo import seed_everything
    from fastgrpo.trainer.sft import run_sft

    tmp = tmp_path_factory.mktemp("fusion")
    cfg = _cfg(tmp, "sft.steps=80", "sft.batch_size=32", "fusion.steps=50", "sft.noise=0")
    seed_everything(0)
    task = ArithmeticTask(50, 40, seed=0)
    before, tok = build_tiny_model(seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    run_sft(cfg, before, tok, task)
    after = copy.deepcopy(before)
    traces = _traces(task, tok, 400)
    rows = fusion.build_mix(traces, fusion.ModeSwitch(tok, cfg.fusion, templated=False), cfg)
    fusion.fusion_sft(cfg, after, tok, rows, out_dir=str(tmp / "run"))
    return cfg, task, tok, before, after, build_rewards(cfg.rewards, task, cfg.rollout.max_new_tokens), traces, tmp


def _no_think_empty(model, tok, task, cfg):
    from fastgrpo.rollout import make_engine

    eng = make_engine("torch", model, tok)
    sw = fusion.ModeSwitch(tok, cfg.fusion, templated=False)
    outs = eng.generate([sw.prompt(p.prompt, False) for p in task.heldout], n=1,
                        sampling=SamplingConfig(temperature=0.0, max_new_tokens=24))
    return sum(g[0].text.startswith("<think></think>") for g in outs) / len(outs)


def test_fusion_sft_teaches_the_direct_answer(fused):
    cfg, task, tok, before, after, _, _, tmp = fused
    assert is_complete_model_dir(str(tmp / "run" / "fusion" / "model"))
    rows = [json.loads(x) for x in open(tmp / "run" / "fusion" / "metrics.jsonl")]
    assert len(rows) == cfg.fusion.steps and rows[-1]["fusion/sft_loss"] < rows[0]["fusion/sft_loss"]
    e0, e1 = _no_think_empty(before, tok, task, cfg), _no_think_empty(after, tok, task, cfg)
    assert e0 <= 0.1 and e1 >= 0.8, (e0, e1)


def test_sweep_rows_and_budgets(fused):
    from fastgrpo.rollout import make_engine
    from fastgrpo.recipes.budget_sweep import full_budget_of

    cfg, task, tok, _, after, rewards, traces, _ = fused
    full = full_budget_of(traces)
    assert full == max(t.think_tokens for t in traces)
    sw = fusion.ModeSwitch(tok, cfg.fusion, templated=False)
    rows = run_sweep(make_engine("torch", after, tok), task.heldout, rewards, sw, cfg, full)
    fr = cfg.fusion.budget_fractions
    assert [(r["mode"], r["fraction"]) for r in rows] == [(m, f) for m in ("think", "no_think") for f in fr]
    for r in rows:
        assert r["budget"] == int(r["fraction"] * full + 0.5) and 0 <= r["accuracy"] <= 1
        assert r["think_tokens_max"] <= r["budget"], r  # the budget is honoured
        assert r["num_problems"] == len(task.heldout)
    at = {(r["mode"], r["fraction"]): r for r in rows}
    assert at[("think", 0.0)]["interrupted"] == 1.0 and at[("think", 0.0)]["think_tokens_max"] == 0
    assert at[("no_think", 1.0)]["empty_think"] >= 0.8 and at[("no_think", 1.0)]["interrupted"] == 0.0
    assert at[("think", 1.0)]["think_tokens_mean"] > at[("no_think", 1.0)]["think_tokens_mean"]


def test_fuse_command_end_to_end(fused, capsys):
    cfg, _, tok, _, after, _, _, tmp = fused
    run = tmp / "rl-run"
    save_model_atomic(after, tok, str(run / "model"))  # stands for the RL run's model
    rl_cfg = copy.deepcopy(cfg)
    rl_cfg.logging.out_dir = str(run)
    dump_config(rl_cfg, str(run / "config.yaml"))
    out = tmp / "fused"
    rc = cli.main(["fuse", "--out", str(out), "--set", f"model.path={run}", "--set", "fusion.steps=3",
                   "--set", "fusion.budget_fractions=[0, 0.5, 1]", "--set", "logging.progress=false"])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert "the RL run's config" in text.out and "verified traces" in text.out
    assert is_complete_model_dir(str(out / "fusion" / "model"))
    lines = open(out / "fusion" / "budget_sweep.csv").read().splitlines()
    assert len(lines) == 1 + 2 * 2 * 3  # header + (before, after) × (think, no_think) × 3 budgets
    summary = json.loads((out / "fusion" / "summary.json").read_text())
    assert summary["fusion/traces"] > 0 and "fusion/after/no_think/accuracy@1" in summary
    assert os.path.isfile(out / "plots" / "budget_sweep.png")


def test_fuse_command_without_a_trained_model(tmp_path, capsys):
    rc = cli.main(["fuse", "--out", str(tmp_path / "f"), "--set", "fusion.max_prompts=16", "--set", "fusion.group_size=2",
                   "--set", "logging.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2
    line = [x for x in err.splitlines() if x.startswith("fastgrpo:")]
    assert len(line) == 1 and "no verified traces: 0 of 32 rollouts of 16 train prompts" in line[0], err
    assert "fusion.min_accuracy=1.0" in line[0] and "Traceback" not in err


def test_fuse_command_bad_budget_fraction(tmp_path, capsys):
    rc = cli.main(["fuse", "--out", str(tmp_path / "f"), "--set", "fusion.budget_fractions=[0.5, 2]"])
    err = capsys.readouterr().err
    assert rc == 2 and "fusion.budget_fractions=[0.5, 2.0]" in err and not (tmp_path / "f").exists()


def test_fusion_stage_after_grpo_in_train(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(["train", "--out", str(out), "--set", "fusion.enabled=true", "--set", "steps=1",
                   "--set", "sft.steps=80", "--set", "sft.batch_size=32", "--set", "sft.noise=0",
                   "--set", "rollout.prompts_per_step=4", "--set", "eval.every=0", "--set", "fusion.steps=2",
                   "--set", "fusion.budget_fractions=[0, 1]"] + [x for s in _FAST for x in ("--set", s)]
                  + ["--set", "logging.progress=false"])
    text = capsys.readouterr()
    assert rc == 0, text.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fusion/traces"] > 0 and "fusion/before/think/accuracy@1" in summary
    assert is_complete_model_dir(str(out / "fusion" / "model"))
    assert os.path.isfile(out / "plots" / "budget_sweep.png") and os.path.isfile(out / "plots" / "accuracy.png")
