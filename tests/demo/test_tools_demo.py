"""The tool demo (`fastgrpo train --demo tools`, fastgrpo/demo/tools.py): the default demo stays as it
was (tokenizer ids, model init); the tool variant's tokenizer is the same wherever it is built; its
SFT traces are episodes whose tool answer is not trained and is what the episode runner renders;
and from the CLI its episodes really call the calculator (episode metrics, the ledger in
samples.jsonl)."""
import dataclasses
import json
import random
import re
import subprocess
import sys

import pytest
import torch

from fastgrpo.demo.default import default_config
from fastgrpo.models.tiny import build_char_tokenizer, char_vocab
from fastgrpo.tasks.arithmetic import ArithmeticTask
from fastgrpo.trainer import build as builders

TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def test_the_default_demo_keeps_its_tokenizer_and_init():
    """No extra tokens in the default demo: the same 104 ids and the same initial weights as a
    plain build_tiny_model; the tool demo's tokens come after every one of them."""
    from fastgrpo.models.tiny import build_tiny_model

    cfg = default_config()
    assert cfg.model.extra_tokens == [] and cfg.data.operation == "+" and cfg.rollout.tools == []
    tok, _ = builders.build_tokenizer(cfg.model)
    assert tok.get_vocab() == build_char_tokenizer().get_vocab() and len(tok) == 104
    model, _ = builders.build_model(cfg.model, tok)
    ref, _ = build_tiny_model(seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    assert model.get_input_embeddings().weight.shape == (104, 64)
    assert torch.equal(model.get_input_embeddings().weight, ref.get_input_embeddings().weight)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    tools = build_char_tokenizer(extra_tokens=TAGS).get_vocab()
    assert {k: tools[k] for k in char_vocab()} == char_vocab()
    assert [tools[t] for t in TAGS] == [104, 105, 106, 107]


def test_the_tool_demo_builds_one_tokenizer_everywhere():
    """The run's tokenizer (build_tokenizer), an async worker's (build_model without one) and a
    LoRA adapter's base (tiny_ref → tiny_config_of) are the same, the tags single tokens."""
    cfg = default_config(demo="tools")
    assert cfg.model.extra_tokens == TAGS and cfg.rollout.tools == ["calculator"]
    run_tok, _ = builders.build_tokenizer(cfg.model)
    model, worker_tok = builders.build_model(cfg.model)  # what build_worker_engine does
    assert worker_tok.get_vocab() == run_tok.get_vocab() and len(run_tok) == 108
    assert model.get_input_embeddings().weight.shape[0] == 108
    base = builders.tiny_config_of(builders.tiny_ref(cfg.model), default_config().model)
    assert builders.tiny_tokenizer(base).get_vocab() == run_tok.get_vocab()
    assert run_tok("<tool_call>{}</tool_call>", add_special_tokens=False)["input_ids"] == [104, *run_tok("{}")[
        "input_ids"], 105]


def test_a_checkpoint_reads_tool_answers_as_training_did(tmp_path):
    """A saved tiny model's tokenizer loads back as the character tokenizer it was (AutoTokenizer
    alone gives Qwen2Tokenizer, which drops the newlines around a tool answer)."""
    from fastgrpo.models.tiny import save_tiny

    cfg = default_config(demo="tools")
    tok, _ = builders.build_tokenizer(cfg.model)
    model, _ = builders.build_model(cfg.model, tok)
    save_tiny(str(tmp_path / "ckpt"), model, tok)
    loaded, _ = builders.build_tokenizer(dataclasses.replace(cfg.model, path=str(tmp_path / "ckpt")))
    text = "412*356=<tool_call>{}</tool_call>\n<tool_response>\n146672\n</tool_response>\n<think>3 5</think>"
    assert loaded(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.padding_side == tok.padding_side


@pytest.mark.parametrize("setting, field", [("model.extra_tokens=[a]", "model.extra_tokens[0]"),
                                            ("model.extra_tokens=['<a b>']", "model.extra_tokens[0]"),
                                            ("data.operation=-", "data.operation"),
                                            ("data.min_operand=49", "data.min_operand")])
def test_bad_tool_demo_settings_name_their_field(setting, field):
    with pytest.raises(ValueError, match=re.escape(f"config {field}=")):
        default_config([setting])


def test_tool_traces_leave_the_tool_answer_untrained():
    """The cold start's episode: call (trained), the tool's answer (mask 0, the very ids the episode
    runner renders for it), final turn + eos (trained); with noise, the answer read back rounded."""
    from fastgrpo.episodes.calls import TOOL_CALL_END, TOOL_CALL_START, ToolCall, parse_tool_calls
    from fastgrpo.episodes.render import TurnRenderer
    from fastgrpo.trainer.sft import _encode_completion

    tok = build_char_tokenizer(extra_tokens=TAGS)
    task = ArithmeticTask(1000, 10, seed=0, operation="*", min_operand=317, tools=["calculator"])
    p = task.train[0]
    a, b = task.operands(p)
    segs = task.sft_completion(p, random.Random(0))
    assert [t for _, t in segs] == [True, False, True]
    calls, errors = parse_tool_calls(segs[0][0])  # the episode runner's parser reads the teacher's call
    assert not errors and calls == [ToolCall("calculator", {"expression": f"{a}*{b}"})]
    assert segs[0][0].startswith(TOOL_CALL_START) and segs[0][0].endswith(TOOL_CALL_END)
    assert segs[2][0] == f"<think>{b}*{a}</think><answer>{a * b}</answer>"
    ids, mask = _encode_completion(tok, segs, tok.eos_token_id)
    (_, env_ids), _ = TurnRenderer(tok).environment([{"role": "tool", "name": "calculator", "content": str(a * b)}])
    n_call = len(tok(segs[0][0], add_special_tokens=False)["input_ids"])
    assert ids[n_call:n_call + len(env_ids)] == env_ids and ids[-1] == tok.eos_token_id
    assert mask == [1.0] * n_call + [0.0] * len(env_ids) + [1.0] * (len(ids) - n_call - len(env_ids))
    rng = random.Random(0)
    noisy = [task.sft_completion(q, rng, noise=0.6) for q in task.train[:500]]
    rounded = [q for q, c in zip(task.train, noisy) if c[2][0].endswith(f"<answer>{int(q.answer) // 1000}000</answer>")]
    assert all(len(c) == 3 for c in noisy) and 250 < len(rounded) < 350  # ~60% read back rounded
    plain = ArithmeticTask(1000, 10, seed=0, operation="*", min_operand=317)  # the baseline: no tool, exact
    assert plain.sft_completion(p, random.Random(0), noise=0.6) == segs[2][0]


def test_masked_sft_loss_is_the_mean_over_trained_tokens(tmp_path):
    """SFT's loss with segments is the token-mean NLL over the trained tokens only (call, final
    turn, eos), computed here from a plain forward of the same weights."""
    import copy

    from trainer_helpers import tiny_cfg

    from fastgrpo.models.tiny import build_tiny_model
    from fastgrpo.trainer.sft import _encode_completion, run_sft

    tok = build_char_tokenizer(extra_tokens=TAGS)
    task = ArithmeticTask(1000, 10, seed=0, operation="*", min_operand=317, tools=["calculator"])
    task.train = task.train[:4]
    model, _ = build_tiny_model(tokenizer=tok, hidden_size=32, num_hidden_layers=1, intermediate_size=64)
    ref = copy.deepcopy(model)
    nll, n = 0.0, 0
    with torch.no_grad():
        for p in task.train:
            prompt = tok(p.prompt, add_special_tokens=False)["input_ids"]
            comp, mask = _encode_completion(tok, task.sft_completion(p, random.Random(0)), tok.eos_token_id)
            logp = torch.log_softmax(ref(torch.tensor([prompt + comp])).logits[0].double(), -1)
            at = torch.arange(len(prompt) - 1, len(prompt) + len(comp) - 1)
            lp = logp[at, torch.tensor(comp)]
            m = torch.tensor(mask, dtype=torch.float64)
            assert 0 < m.sum() < len(comp)
            nll -= float((lp * m).sum())
            n += int(m.sum())
    cfg = tiny_cfg(tmp_path, "sft.steps=1", "sft.batch_size=4", "sft.noise=0")
    got = run_sft(cfg, model, tok, task, log=lambda m: None)
    assert got["sft/tokens"] == n
    assert got["sft/loss"] == pytest.approx(nll / n, rel=1e-5)


def test_tool_demo_from_the_cli_calls_the_calculator(tmp_path):
    """`fastgrpo train --demo tools`, tiny steps: the run ends, its episodes call the calculator
    (episode/tool_calls > 0) and the ledger holds, after each call, the calculator's answer to the
    expression the model wrote."""
    from fastgrpo.episodes.builtin import calculator

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "fastgrpo.cli", "train", "--demo", "tools", "--out", str(out),
                        "--set", "sft.steps=150", "--set", "sft.noise=0", "--set", "sft.lr=1e-2", "--set", "steps=2",
                        "--set", "rollout.prompts_per_step=8", "--set", "eval.max_problems=8",
                        "--set", "logging.samples_every=1", "--set", "logging.progress=false"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "held-out accuracy" in r.stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    calls = [m["episode/tool_calls"] for m in steps if "episode/tool_calls" in m]
    assert len(calls) == 2 and max(calls) > 0.5, calls
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    checked = 0
    for s in samples:
        segs = s["episode"]
        for turn, env in zip(segs, segs[1:]):
            if turn["kind"] == "sampled" and env["kind"] == "environment":
                m = re.search(r'"expression":"([^"]*)"', turn["text"])
                if m:
                    try:
                        want = calculator(m.group(1))
                    except ValueError:
                        continue
                    assert env["text"] == f"\n<tool_response>\n{want}\n</tool_response>\n"
                    checked += 1
    assert checked > 0
