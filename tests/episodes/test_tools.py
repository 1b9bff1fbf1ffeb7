"""Tool schemas from type hints and docstrings, and every load error of rollout.tools."""
import os

import pytest

from fastgrpo.episodes.tools import check_arguments, load_tool, load_tools, tool_schema


def test_schema_from_hints_and_docstring(here):
    tool = load_tool("bad_tools:typed", base_dir=here)
    schema = tool.schema
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "typed" and fn["description"] == "Exercise every plain type."
    props = fn["parameters"]["properties"]
    assert fn["parameters"]["type"] == "object"
    assert {k: v["type"] for k, v in props.items()} == {
        "count": "integer", "ratio": "number", "name": "string", "flag": "boolean", "items": "array",
        "note": "string", "opt": "number"}
    assert props["items"]["items"] == {"type": "integer"}
    assert props["count"]["description"] == "an integer."
    assert fn["parameters"]["required"] == ["count", "ratio", "name", "flag", "items"]  # defaults: optional
    assert "return" not in fn  # the OpenAI shape
    assert tool_schema(tool.fn) == schema


def test_file_spec_and_module_spec_agree(here):
    by_file = load_tool("bad_tools.py:typed", base_dir=here)
    by_module = load_tool("bad_tools:typed", base_dir=here)
    assert by_file.schema == by_module.schema
    assert by_file.origin == os.path.join(here, "bad_tools.py") + ":typed"
    assert by_file.fn(1, 2.0, "n", True, [1]) == "1 2.0 n True [1] x 0.5"


def test_builtin_names():
    tools = load_tools(["calculator", "python"])
    assert set(tools) == {"calculator", "python"}
    assert tools["python"].sandboxed is not None and tools["calculator"].sandboxed is None
    assert tools["calculator"].parameters["required"] == ["expression"]


@pytest.mark.parametrize("spec, words", [
    ("bad_tools:no_hint", ["parameter 'b' has no type hint", "JSON schema"]),
    ("bad_tools:no_doc", ["no docstring"]),
    ("bad_tools:undocumented_arg", ["parameter 'b' is not described", "Args:"]),
    ("bad_tools:star_args", ["*args"]),
    ("bad_tools:NotAFunction", ["not a function"]),
    ("bad_tools:CONSTANT", ["not a function"]),
    ("bad_tools:missing", ["no such function 'missing'", "typed"]),
    ("no_such_module_xyz:f", ["does not import", "no_such_module_xyz"]),
    ("raises_on_import:f", ["does not import", "RuntimeError", "cannot be imported"]),
    ("missing_file.py:f", ["file not found"]),
    ("calculater", ["expected 'module:function'", "calculator"]),
    ("bad_tools:", ["Python name after the colon"]),
])
def test_load_errors_name_the_field(here, spec, words):
    with pytest.raises(ValueError) as e:
        load_tool(spec, base_dir=here)
    msg = str(e.value)
    assert msg.startswith(f"config rollout.tools: {spec!r}: "), msg
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


def test_duplicate_names_and_bad_list(here):
    with pytest.raises(ValueError, match="already listed"):
        load_tools(["bad_tools:typed", "bad_tools.py:typed"], base_dir=here)
    with pytest.raises(ValueError, match="expected a list"):
        load_tools("calculator")


def test_check_arguments(here):
    tool = load_tool("bad_tools:typed", base_dir=here)
    good = {"count": 3.0, "ratio": 1, "name": "a", "flag": False, "items": [1, 2]}
    args, problem = check_arguments(tool, good)
    assert problem is None and args["count"] == 3 and isinstance(args["count"], int)
    for bad, word in (({**good, "count": "3"}, "'count' must be integer"),
                      ({**good, "flag": 1}, "'flag' must be boolean"),
                      ({**good, "count": True}, "'count' must be integer"),
                      ({**good, "items": [1, "x"]}, "'items' must be array of integer"),
                      ({k: v for k, v in good.items() if k != "name"}, "missing argument 'name' (string)"),
                      ({**good, "colour": "red"}, "unexpected argument 'colour'")):
        args, problem = check_arguments(tool, bad)
        assert args is None and word in problem, problem
    assert "must be a JSON object" in check_arguments(tool, [1])[1]
