"""Parsing tool calls out of a turn's text, tool results, the fallback system prompt."""
import json
from types import SimpleNamespace

from fastgrpo.episodes.calls import (TOOL_CALL_END, ToolCall, format_tool_call, format_tool_result,
                                     format_tool_results, parse_tool_calls, parse_tool_calls_ordered,
                                     template_supports_tools, tools_system_prompt)


def test_one_call():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2**10"}}\n</tool_call>'
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "2**10"})] and errors == []


def test_two_calls_and_round_trip():
    a, b = ToolCall("add", {"a": 1, "b": 2}), ToolCall("echo", {"text": "héllo <x>"})
    text = f"first {format_tool_call(a)} then {format_tool_call(b)} done"
    assert parse_tool_calls(text) == ([a, b], [])


def test_unclosed_last_call_is_parsed():
    # the engine stops at TOOL_CALL_END and may drop the stop string from the text
    text = 'x <tool_call>{"name": "add", "arguments": {"a": 1}}'
    assert parse_tool_calls(text) == ([ToolCall("add", {"a": 1})], [])
    assert parse_tool_calls("cut off <tool_call>") == ([], [])
    assert TOOL_CALL_END == "</tool_call>"


def test_bad_json():
    calls, errors = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>')
    assert calls == [] and len(errors) == 1
    assert errors[0].startswith("tool call 1: invalid JSON") and "\n" not in errors[0]


def test_missing_name_and_bad_shapes():
    items = parse_tool_calls_ordered(
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "ok", "arguments": "{\\"a\\": 2}"}</tool_call>'
        '<tool_call>[1, 2]</tool_call>'
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "f", "arguments": {}, "extra": 1}</tool_call>'
        '<tool_call>{"name": "g", "parameters": {"x": 1}}</tool_call>')
    assert 'missing "name"' in items[0]
    assert items[1] == ToolCall("ok", {"a": 2})  # arguments as a JSON string (OpenAI's wire shape)
    assert "expected a JSON object" in items[2]
    assert '"arguments" must be a JSON object' in items[3]
    assert "unknown field 'extra'" in items[4]
    assert items[5] == ToolCall("g", {"x": 1})  # Llama 3.x writes "parameters"
    calls, errors = parse_tool_calls("".join(f"<tool_call>{json.dumps({'name': 'n'})}</tool_call>" for _ in range(2)))
    assert calls == [ToolCall("n", {}), ToolCall("n", {})] and errors == []


def test_text_without_calls():
    assert parse_tool_calls("The answer is 42.") == ([], [])
    assert parse_tool_calls("") == ([], [])


def test_results_and_system_prompt():
    assert format_tool_result("add", "3") == {"role": "tool", "name": "add", "content": "3"}
    fallback = format_tool_result("add", "3", native=False)
    assert fallback["role"] == "user" and fallback["content"] == "<tool_response>\n3\n</tool_response>"
    results = [SimpleNamespace(name="a", output="1"), SimpleNamespace(name="b", output="2")]
    assert len(format_tool_results(results)) == 2
    grouped = format_tool_results(results, native=False)
    assert len(grouped) == 1 and grouped[0]["content"].count("<tool_response>") == 2
    schema = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {}}}
    prompt = tools_system_prompt([schema])
    assert json.dumps(schema) in prompt and "<tool_call>" in prompt and "<tools>" in prompt


def test_template_supports_tools():
    with_tools = SimpleNamespace(chat_template="{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
                                               "{{ m.content }}{% endfor %}")
    without = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% break %}{% endfor %}")
    assert template_supports_tools(with_tools)
    assert not template_supports_tools(without)
    assert not template_supports_tools(SimpleNamespace(chat_template=None))
    assert template_supports_tools(SimpleNamespace(chat_template={"default": "x", "tool_use": "{{ tools }}"}))
