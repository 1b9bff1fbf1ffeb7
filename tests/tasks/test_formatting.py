"""Prompt text: prompt / messages columns, system prompt, few-shot, chat template auto / on / off
with a real tokenizer (SmolLM2's ChatML) and one without a template, enable_thinking passed
through, and SFT completions that end as the template's assistant turn would."""
import copy
import json

import pytest

from fastgrpo.config import DataConfig
from fastgrpo.tasks.build import build_task
from fastgrpo.tasks.formatting import PromptFormatter, row_turns

# a template that reads enable_thinking as Qwen3's does (an empty think block when it is false)
_NO_THINK = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
THINK_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}" + _NO_THINK + "{% endif %}"
                  "{{ m['content'] }}</{{ m['role'] }}>{% endfor %}{% if add_generation_prompt %}<assistant>" + _NO_THINK
                  + "{% endif %}")


def _write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


@pytest.fixture
def plain_tokenizer(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = None
    return tok


@pytest.fixture
def think_tokenizer(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = THINK_TEMPLATE
    return tok


def test_chat_template_auto_applies_smollm2_chatml(tmp_path, smol_tokenizer):
    p = _write(tmp_path, [{"prompt": "What is 2+2?", "answer": "4", "completion": "It is 4."}])
    task = build_task(DataConfig(path=p, system_prompt="Be brief."), smol_tokenizer)
    (q,) = task.train
    assert q.prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                        "<|im_start|>assistant\n")
    # the turn ends <|im_end|>\n; the SFT trainer appends eos (= <|im_end|>) itself
    assert smol_tokenizer.eos_token == "<|im_end|>" and q.completion == "It is 4."
    assert task.chat_template_applied and task.has_completions
    # the template's default system prompt when none is set
    (q,) = build_task(DataConfig(path=p), smol_tokenizer).train
    assert q.prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_chat_template_off_and_absent(tmp_path, smol_tokenizer, plain_tokenizer):
    p = _write(tmp_path, [{"prompt": "What is 2+2?", "answer": "4", "completion": " 4"}])
    for tok, mode in ((smol_tokenizer, "off"), (plain_tokenizer, "auto"), (None, "auto")):
        (q,) = build_task(DataConfig(path=p, chat_template=mode, system_prompt="Be brief."), tok).train
        assert q.prompt == "Be brief.\n\nWhat is 2+2?" and q.completion == " 4"
    with pytest.raises(ValueError, match=r"data.chat_template=on: the tokenizer \(.*\) has no chat template"):
        build_task(DataConfig(path=p, chat_template="on"), plain_tokenizer)
    with pytest.raises(ValueError, match=r"data.chat_template=on: no tokenizer was given"):
        build_task(DataConfig(path=p, chat_template="on"))


def test_messages_column_and_final_assistant_turn(tmp_path, smol_tokenizer):
    rows = [{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi 1+1?"},
                          {"role": "assistant", "content": "2"}], "answer": "2"}]
    task = build_task(DataConfig(path=_write(tmp_path, rows)), smol_tokenizer)
    (q,) = task.train
    assert q.prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi 1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert q.completion == "2" and q.row["messages"][1]["content"] == "Hi 1+1?"
    with pytest.raises(ValueError, match=r"d\.jsonl:1: the row has its own system message and data.system_prompt"):
        build_task(DataConfig(path=_write(tmp_path, rows), system_prompt="T"), smol_tokenizer)
    # TRL's conversational prompt column: a list of messages under `prompt`
    conv = [{"prompt": [{"role": "user", "content": "Q"}], "answer": "1"}]
    (q,) = build_task(DataConfig(path=_write(tmp_path, conv, "c.jsonl"), chat_template="off")).train
    assert q.prompt == "Q"


def test_column_mapping(tmp_path):
    rows = [{"question": "1+1?", "solution": "2", "uid": 11, "trace": "so 2"}, {"question": "2+2?", "solution": "4", "uid": 12, "trace": "so 4"}]
    cols = {"prompt": "question", "answer": "solution", "id": "uid", "completion": "trace"}
    task = build_task(DataConfig(path=_write(tmp_path, rows), columns=cols))
    assert [(q.id, q.prompt, q.answer, q.completion, q.key) for q in task.train] == [
        (11, "1+1?", "2", "so 2", "11"), (12, "2+2?", "4", "so 4", "12")]


def test_few_shot_prefix_excluded_from_splits(tmp_path, smol_tokenizer):
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4", "completion": "4"},
            {"prompt": "3+3?", "answer": "6", "completion": "6"}, {"prompt": "4+4?", "answer": "8"}]
    p = _write(tmp_path, rows)
    task = build_task(DataConfig(path=p, few_shot=1, chat_template="off"))
    assert [q.prompt for q in task.train] == ["2+2?4\n\n1+1?", "2+2?4\n\n3+3?", "2+2?4\n\n4+4?"]
    assert [q.key for q in task.few_shot] == [f"{p}:2"] and task.few_shot[0].completion == "4"
    task = build_task(DataConfig(path=p, few_shot=2, system_prompt="S"), smol_tokenizer)
    assert [q.answer for q in task.train] == ["2", "8"]
    assert task.train[0].prompt == ("<|im_start|>system\nS<|im_end|>\n"
                                    "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                                    "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n"
                                    "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match=r"data.few_shot=3: only 2 train rows .* have a reference completion"):
        build_task(DataConfig(path=p, few_shot=3))


def test_enable_thinking_passed_only_when_set(tmp_path, think_tokenizer):
    p = _write(tmp_path, [{"prompt": "Q", "answer": "1", "completion": "A"}])
    (q,) = build_task(DataConfig(path=p, enable_thinking=False), think_tokenizer).train
    assert q.prompt == "<user>Q</user><assistant><think></think>" and q.completion == "A</assistant>"
    for flag in (None, True):
        (q,) = build_task(DataConfig(path=p, enable_thinking=flag), think_tokenizer).train
        assert q.prompt == "<user>Q</user><assistant>"


def test_row_turns_errors():
    with pytest.raises(ValueError, match=r"r1: column 'prompt' is empty"):
        row_turns("  ", "r1", "prompt")
    with pytest.raises(ValueError, match=r"r1: column 'messages' message 0 is not a \{role: str, content: str\}"):
        row_turns([{"role": "user"}], "r1", "messages")
    with pytest.raises(ValueError, match=r"r1: column 'messages' has no non-empty user message"):
        row_turns([{"role": "system", "content": "x"}], "r1", "messages")


def test_plain_multi_turn_transcript():
    f = PromptFormatter(None, "auto")
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert f.prompt(turns) == "User: a\n\nAssistant: b\n\nUser: c\n\nAssistant:"
