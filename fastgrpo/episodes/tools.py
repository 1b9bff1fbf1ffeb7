"""Tools as typed Python functions: the schema the model sees, and loading them from a config.

A tool is a plain function with a type hint on every parameter and a Google-style docstring
(`Args:` gives each parameter's description). Its schema is the OpenAI / Hugging Face chat
template shape, `{"type": "function", "function": {"name", "description", "parameters"}}`,
built by `transformers.utils.get_json_schema` (the same builder TRL's `GRPOTrainer(tools=...)`
and `apply_chat_template(tools=...)` use), so a tool reads the same here as there. Departures:
the `return` entry get_json_schema adds is dropped (the OpenAI shape has none), and every
failure is re-worded as one line naming the config field `rollout.tools`, the spec, and what
would be right.

Specs (`rollout.tools` entries): `module:function` (imported with the config file's folder and
the working directory put first on sys.path for the import), `path/to/file.py:function`
(relative to the config file's folder, then the working directory), or a built-in name
(`calculator`, `python`, see builtin.py).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

BUILTIN_TOOLS = {
    "calculator": "fastgrpo.episodes.builtin:calculator",
    "python": "fastgrpo.episodes.builtin:python",
}
_JSON_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


@dataclass(frozen=True)
class Tool:
    name: str  # the name the model calls it by (the function's __name__)
    description: str  # the docstring's summary (what the model reads)
    parameters: dict  # JSON schema of the arguments: {"type": "object", "properties", "required"}
    spec: str  # the spec as written in the config ("my_tools:add"), for messages
    fn: Callable = field(repr=False, compare=False)  # the function, loaded in this process
    origin: str = ""  # reloadable form of the spec in another process ("/abs/tools.py:add", "pkg.mod:add")
    paths: Tuple[str, ...] = ()  # absolute folders put first on sys.path while (re)importing origin
    sandboxed: Optional[Callable] = field(default=None, repr=False, compare=False)  # set for tools that
    # isolate themselves (the python tool): the executor runs this on the sandbox's RewardPool instead

    @property
    def schema(self) -> dict:
        """The chat-template entry: {"type": "function", "function": {...}}."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class SpecError(ValueError):
    """A config entry naming a tool or an environment is wrong (one line: field, spec, what)."""


def _err(field_name: str, spec: str, what: str) -> SpecError:
    return SpecError(f"config {field_name}: {spec!r}: {what}")


def tool_schema(fn: Callable, *, spec: Optional[str] = None, field_name: str = "rollout.tools") -> dict:
    """The JSON schema of `fn` from its type hints and docstring (ValueError, one line, if it has
    none or they cannot be turned into a schema)."""
    spec = spec if spec is not None else getattr(fn, "__name__", repr(fn))
    if inspect.isclass(fn) or not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        what = "class" if inspect.isclass(fn) else type(fn).__name__
        raise _err(field_name, spec, f"is not a function (it is a {what}); a tool is a plain "
                                     "Python function with typed parameters and a docstring")
    if not inspect.getdoc(fn):
        raise _err(field_name, spec, "has no docstring; a tool needs one (its first paragraph tells the model "
                                     "what the tool does, its Args: section what each parameter means)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve
        raise _err(field_name, spec, f"its type hints do not resolve ({type(e).__name__}: {e})") from None
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise _err(field_name, spec, f"parameter '{p.name}' is *args / **kwargs; tool parameters must be "
                                         "named ones (each becomes a field of the tool's JSON schema)")
        if p.name not in hints:
            raise _err(field_name, spec, f"parameter '{p.name}' has no type hint; every tool parameter needs "
                                         "one (it becomes the tool's JSON schema)")
    from transformers.utils import get_json_schema  # lazy: transformers costs ~1 s to import

    try:
        schema = get_json_schema(fn)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "no description for the argument" in msg:
            arg = msg.rsplit("'", 2)[-2] if msg.count("'") >= 2 else "?"
            raise _err(field_name, spec, f"parameter '{arg}' is not described in the docstring; add it under "
                                         f"'Args:' as '{arg}: what it means'") from None
        raise _err(field_name, spec, f"cannot build its JSON schema: {msg} (supported hints: int, float, str, "
                                     "bool, list[...], dict, Optional, Union, Literal)") from None
    schema["function"].pop("return", None)
    return schema


# -- resolving specs ---------------------------------------------------------------------------
def _search_dirs(base_dir: Optional[str]) -> Tuple[str, ...]:
    dirs = [os.path.abspath(base_dir)] if base_dir else []
    cwd = os.path.abspath(os.getcwd())
    return tuple(dict.fromkeys(dirs + [cwd]))


def _load_file(path: str) -> Any:
    """Import a .py file under a name unique to its path (registered in sys.modules first, which
    dataclasses and pickling by reference inside the module need)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    name = f"fastgrpo_user_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = os.path.dirname(path)
    added = folder not in sys.path
    if added:  # the file may import its siblings
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    return module


def _import_module(name: str, paths: Tuple[str, ...]) -> Any:
    added = [p for p in paths if p not in sys.path]
    sys.path[:0] = added
    try:
        return importlib.import_module(name)
    finally:
        for p in added:
            if p in sys.path:
                sys.path.remove(p)


def resolve_spec(spec: Any, base_dir: Optional[str], field_name: str, kind: str,
                 builtins: Optional[dict] = None) -> Tuple[Any, str, Tuple[str, ...]]:
    """(object, origin, paths) for `module:name` / `file.py:name` / a built-in name. `origin` and
    `paths` re-import the same object in another process (`reimport`)."""
    if not isinstance(spec, str) or not spec.strip():
        raise _err(field_name, str(spec), f"expected a string 'module:{kind}' or 'path/to/file.py:{kind}'")
    spec = spec.strip()
    if builtins and spec in builtins:
        spec_full, shown = builtins[spec], spec
    elif ":" not in spec:
        names = f"; built-in names: {', '.join(sorted(builtins))}" if builtins else ""
        raise _err(field_name, spec, f"expected 'module:{kind}' or 'path/to/file.py:{kind}'{names}")
    else:
        spec_full, shown = spec, spec
    mod_part, _, attr = spec_full.rpartition(":")
    if not mod_part or not attr.isidentifier():
        raise _err(field_name, shown, f"expected 'module:{kind}' with a Python name after the colon")
    paths = _search_dirs(base_dir)
    try:
        if mod_part.endswith(".py") or "/" in mod_part or os.sep in mod_part:
            cands = [mod_part] if os.path.isabs(mod_part) else [os.path.join(d, mod_part) for d in paths]
            path = next((os.path.abspath(c) for c in cands if os.path.isfile(c)), None)
            if path is None:
                raise _err(field_name, shown, f"file not found (looked in: {', '.join(paths)})")
            module, origin = _load_file(path), f"{path}:{attr}"
        else:
            try:
                module = _import_module(mod_part, paths)
            except ModuleNotFoundError as e:
                if e.name and (mod_part == e.name or mod_part.startswith(e.name + ".")):
                    raise _err(field_name, shown, f"does not import: no module named '{e.name}' (looked in "
                                                  f"{', '.join(paths)} and sys.path)") from None
                raise
            origin = f"{mod_part}:{attr}"
    except (SpecError, KeyboardInterrupt):
        raise
    except BaseException as e:  # the module itself raised (or exited) while importing
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise _err(field_name, shown, f"does not import: {type(e).__name__}" + (f": {detail}" if detail else "")) from None
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:12]
        raise _err(field_name, shown, f"no such {kind} '{attr}' in {mod_part} (it defines: {', '.join(public)})")
    return getattr(module, attr), origin, paths


def reimport(origin: str, paths: Tuple[str, ...]) -> Any:
    """The object `origin` names, imported in this process (a worker or environment child)."""
    mod_part, _, attr = origin.rpartition(":")
    if mod_part.endswith(".py") and os.path.isabs(mod_part):
        return getattr(_load_file(mod_part), attr)
    return getattr(_import_module(mod_part, tuple(paths)), attr)


def load_tool(spec: str, base_dir: Optional[str] = None, *, field_name: str = "rollout.tools") -> Tool:
    """Resolve one `rollout.tools` entry into a Tool (ValueError naming the field on any problem)."""
    fn, origin, paths = resolve_spec(spec, base_dir, field_name, "function", BUILTIN_TOOLS)
    schema = tool_schema(fn, spec=spec.strip(), field_name=field_name)["function"]
    return Tool(name=schema["name"], description=schema.get("description", ""), parameters=schema["parameters"],
                spec=spec.strip(), fn=fn, origin=origin, paths=paths,
                sandboxed=getattr(fn, "__fastgrpo_sandboxed__", None))


def load_tools(specs, base_dir: Optional[str] = None) -> dict:
    """{name: Tool} for a list of specs; two tools with one name are refused."""
    if isinstance(specs, str) or not isinstance(specs, (list, tuple)):
        raise ValueError(f"config rollout.tools: expected a list of specs, got {type(specs).__name__}")
    out: dict = {}
    for s in specs:
        t = load_tool(s, base_dir)
        if t.name in out:
            raise ValueError(f"config rollout.tools: {s!r}: a tool named '{t.name}' is already listed "
                             f"({out[t.name].spec!r}); tool names must be unique")
        out[t.name] = t
    return out


def tool_from_function(fn: Callable) -> Tool:
    """A Tool for a function object (its module must be importable by name in a worker)."""
    schema = tool_schema(fn)["function"]
    origin = f"{fn.__module__}:{fn.__qualname__}" if "." not in fn.__qualname__ else ""
    return Tool(name=schema["name"], description=schema.get("description", ""), parameters=schema["parameters"],
                spec=origin or fn.__name__, fn=fn, origin=origin, paths=_search_dirs(None),
                sandboxed=getattr(fn, "__fastgrpo_sandboxed__", None))


# -- arguments ---------------------------------------------------------------------------------
def _type_ok(value: Any, schema: dict) -> Tuple[bool, Any]:
    """(ok, value) for one value against a get_json_schema fragment; integral floats pass as ints
    (models often write 3.0 for 3)."""
    if value is None and schema.get("nullable"):
        return True, None
    if "enum" in schema and value not in schema["enum"]:
        return False, value
    types = schema.get("type")
    if types is None or types == "any":
        return True, value
    for t in (types if isinstance(types, list) else [types]):
        py = _JSON_TYPES.get(t)
        if py is None:
            return True, value
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return True, int(value)
        if isinstance(value, bool) and t not in ("boolean",):
            continue
        if isinstance(value, py):
            if t == "array" and isinstance(schema.get("items"), dict):
                items = [_type_ok(v, schema["items"]) for v in value]
                if not all(ok for ok, _ in items):
                    continue
                value = [v for _, v in items]
            return True, value
    return False, value


def _describe(schema: dict) -> str:
    t = schema.get("type", "any")
    t = " or ".join(t) if isinstance(t, list) else t
    if t == "array" and isinstance(schema.get("items"), dict):
        t = f"array of {_describe(schema['items'])}"
    if "enum" in schema:
        t += f" (one of {', '.join(json.dumps(v) for v in schema['enum'])})"
    return t


def check_arguments(tool: Tool, arguments: Any) -> Tuple[Optional[dict], Optional[str]]:
    """(arguments, None) when they fit the tool's schema, else (None, a one-line message for the
    model): missing, unexpected or wrongly typed arguments."""
    if not isinstance(arguments, dict):
        return None, f"tool '{tool.name}': arguments must be a JSON object, got {type(arguments).__name__}"
    props = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return None, (f"tool '{tool.name}': missing argument{'s' if len(missing) > 1 else ''} "
                      + ", ".join(f"'{k}' ({_describe(props.get(k, {}))})" for k in missing))
    extra = [k for k in arguments if k not in props]
    if extra:
        return None, (f"tool '{tool.name}': unexpected argument{'s' if len(extra) > 1 else ''} "
                      + ", ".join(repr(k) for k in extra) + f"; it takes: {', '.join(props) or 'no arguments'}")
    out = {}
    for k, v in arguments.items():
        ok, v2 = _type_ok(v, props[k])
        if not ok:
            return None, f"tool '{tool.name}': argument '{k}' must be {_describe(props[k])}, got {json.dumps(v)[:80]}"
        out[k] = v2
    return out, None


def result_text(value: Any) -> str:
    """A tool's return value as the text the model reads: strings as they are, JSON for plain data,
    str() for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple, int, float, bool)) or value is None:
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
    return str(value)
