"""Tool calls in a model turn's text, tool results, and the tool list as a system prompt.

The call format is the Hermes / Qwen one that most chat templates with tool support render and
parse (Qwen2.5 / Qwen3, Hermes 2/3, and the templates derived from them):

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2**10"}}
    </tool_call>

one JSON object per tag, any number of tags per turn. The engine stops a turn at
`TOOL_CALL_END` (stop-at-tool-call), so the text of a turn may end with an unclosed final
`<tool_call>{...}`: engines drop the stop string from their output by default (vLLM's
`include_stop_str_in_output=False`); such a trailing call is parsed as if closed. Text is only
parsed here: the ids the model sampled stay the ids the trainer trains on (nothing is
re-encoded). `arguments` may also arrive as a JSON string (OpenAI's wire shape) or under
`parameters` (Llama 3.x's); both are accepted. Departure from the chat templates' own parsers
(TRL / transformers `parse_response`): a call that does not parse does not vanish; it comes back
as an error text the model reads on its next turn.

For tokenizers whose chat template has no `tools=` support (`template_supports_tools` is false),
`tools_system_prompt` renders the documented fallback: the tools' JSON schemas between
`<tools></tools>` and the call format above, as the system prompt text, and
`format_tool_result(..., native=False)` wraps results in `<tool_response>` inside a user message
(what Qwen's template does with `role: tool` messages).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable, List, Tuple

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.DOTALL)
_MAX_ERROR_SNIPPET = 80  # characters of a bad call quoted back to the model


@dataclass(frozen=True)
class ToolCall:
    name: str  # the tool the model asked for
    arguments: dict = field(default_factory=dict)  # its arguments, decoded from JSON


def _snippet(body: str) -> str:
    body = " ".join(body.split())
    return body if len(body) <= _MAX_ERROR_SNIPPET else body[:_MAX_ERROR_SNIPPET] + "..."


def _one(body: str, i: int):
    """A ToolCall, or an error text, for the JSON between one pair of tags."""
    where = f"tool call {i + 1}"
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        return f"{where}: invalid JSON ({msg}) in {_snippet(body)!r}"
    if not isinstance(obj, dict):
        return f'{where}: expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {type(obj).__name__}'
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'{where}: missing "name" (expected {{"name": "<tool>", "arguments": {{...}}}})'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI's wire format carries arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"{where} ({name}): arguments are not valid JSON ({e.msg})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f'{where} ({name}): "arguments" must be a JSON object, got {type(args).__name__}'
    extra = sorted(set(obj) - {"name", "arguments", "parameters", "id", "type"})
    if extra:
        return f'{where} ({name}): unknown field{"s" if len(extra) > 1 else ""} {", ".join(map(repr, extra))}; ' \
               'expected only "name" and "arguments"'
    return ToolCall(name.strip(), args)


def parse_tool_calls(text: str) -> Tuple[List[ToolCall], List[str]]:
    """(calls, errors) in a turn's text: every `<tool_call>{...}</tool_call>` in order (a final
    unclosed one included); errors are short texts for the model (bad JSON, unknown shape)."""
    calls: List[ToolCall] = []
    errors: List[str] = []
    for item in parse_tool_calls_ordered(text):
        (calls if isinstance(item, ToolCall) else errors).append(item)
    return calls, errors


def parse_tool_calls_ordered(text: str) -> list:
    """The calls and error texts of a turn in the order they appear (what ToolExecutor.submit
    takes: an error text becomes a `parse_error` result in its place)."""
    if not isinstance(text, str) or TOOL_CALL_START not in text:
        return []
    out = []
    for i, m in enumerate(_CALL_RE.finditer(text)):
        body = m.group(1).strip()
        if not m.group(0).endswith(TOOL_CALL_END) and not body:
            continue  # a bare trailing "<tool_call>" (cut by the length limit): nothing was asked
        out.append(_one(body, i))
    return out


def format_tool_call(call: ToolCall) -> str:
    """The tag form of a call (for prompts, examples and tests)."""
    return f"{TOOL_CALL_START}\n{json.dumps({'name': call.name, 'arguments': call.arguments}, ensure_ascii=False)}" \
           f"\n{TOOL_CALL_END}"


def format_tool_result(name: str, result_text: str, *, native: bool = True) -> dict:
    """The message that carries one tool result back to the model. `native`: a `role: tool`
    message for templates that render tools; otherwise a user message with the result between
    `<tool_response>` tags (the documented fallback)."""
    if native:
        return {"role": "tool", "name": name, "content": result_text}
    return {"role": "user", "content": f"{TOOL_RESPONSE_START}\n{result_text}\n{TOOL_RESPONSE_END}"}


def format_tool_results(results: Iterable, *, native: bool = True) -> list:
    """Messages for a turn's results (objects with `.name` and `.output`, e.g. ToolResult). In the
    fallback the results of one turn share one user message, as Qwen's template groups them."""
    results = list(results)
    if native:
        return [format_tool_result(r.name, r.output) for r in results]
    if not results:
        return []
    body = "\n".join(f"{TOOL_RESPONSE_START}\n{r.output}\n{TOOL_RESPONSE_END}" for r in results)
    return [{"role": "user", "content": body}]


def tools_system_prompt(tools: Iterable) -> str:
    """The tool list as system-prompt text for chat templates without `tools=` support: each
    tool's JSON schema (a dict, or an object with `.schema`) and the call format."""
    schemas = [t.schema if hasattr(t, "schema") else t for t in tools]
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\n"
            "You can call functions to help with the task. Their signatures, as JSON schemas, are "
            f"between <tools></tools> tags:\n<tools>\n{lines}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments between "
            f"{TOOL_CALL_START}{TOOL_CALL_END} tags, one tag per call:\n"
            f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{TOOL_CALL_END}\n'
            f"Each result comes back between {TOOL_RESPONSE_START}{TOOL_RESPONSE_END} tags.")


def _template_text(tokenizer) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):  # named templates ("default", "tool_use", ...)
        return "\n".join(v for v in tpl.values() if isinstance(v, str))
    return tpl if isinstance(tpl, str) else ""


def template_supports_tools(tokenizer) -> bool:
    """True when the tokenizer's chat template reads a `tools` variable (so `apply_chat_template(
    tools=...)` renders them); False for templates that ignore it, or no template."""
    text = _template_text(tokenizer)
    if not text:
        return False
    try:
        import jinja2
        from jinja2 import meta

        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return "tools" in meta.find_undeclared_variables(env.parse(text))
    except Exception:  # jinja2 missing, or an extension tag the plain environment cannot parse
        return re.search(r"\btools\b", text) is not None
