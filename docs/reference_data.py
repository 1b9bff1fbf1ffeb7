"""What the generated reference pages say, read from the code: the config fields (with the inline
comments of their dataclasses and the checks of the loader), the command line (from its argparse
parser), the metric names the source emits, and the exception classes it defines.

One module serves two readers: `docs/gen_ref.py` (mkdocs-gen-files) writes the pages from it, and
`tests/test_docs.py` fails when a field, a flag, a metric or an error class has no documentation.
Comments are read with `tokenize` (the interpreter drops them), the fields' places with `ast`;
nothing here hard-codes a module path of the package besides the entry points it documents
(`fastgrpo.config`, `fastgrpo.config.load`, `fastgrpo.cli`).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import fnmatch
import inspect
import io
import pathlib
import re
import tokenize
import typing
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# config fields
# ---------------------------------------------------------------------------------------------


@dataclass
class ConfigField:
    path: str  # dotted name as `--set` takes it: "rollout.group_size"
    name: str
    type: str  # the annotation as written: "Optional[str]"
    default: str  # the default as YAML would write it
    comment: str  # the field's comment(s) in its dataclass
    valid: List[str] = field(default_factory=list)  # what the loader accepts (its checks' "expected ...")


@dataclass
class ConfigSection:
    path: str  # "" for the top level, else "rollout", "rewards.process", "rewards.models.<name>"
    cls: str
    doc: str  # the section's comment (class line or the comment block above its first field)
    fields: List[ConfigField] = field(default_factory=list)


def _comments(source: str) -> Dict[int, Tuple[str, bool]]:
    """line → (comment text without '#', whether the line holds nothing else)."""
    out: Dict[int, Tuple[str, bool]] = {}
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            alone = lines[line - 1].strip().startswith("#")
            out[line] = (tok.string.lstrip("#").strip(), alone)
    return out


def _class_comments(cls) -> Tuple[str, Dict[str, str], Dict[str, str]]:
    """(section comment, field → comment, field → annotation source) of a dataclass, from its
    source: a field's inline comment, preceded by the comment lines right above it (the block
    above the first field is the section's own comment, as is a comment on the `class` line)."""
    path = inspect.getsourcefile(cls)
    source = pathlib.Path(path).read_text()
    comments = _comments(source)
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    section = [comments[node.lineno][0]] if node.lineno in comments and not comments[node.lineno][1] else []
    per_field: Dict[str, str] = {}
    annotations: Dict[str, str] = {}
    first = True
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        annotations[name] = ast.unparse(stmt.annotation).strip("'\"")
        above: List[str] = []
        line = stmt.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        inline = [c for ln, (c, alone) in comments.items() if stmt.lineno <= ln <= stmt.end_lineno and not alone]
        if first and inline:  # the block above a first field that has its own comment: the section's
            section += above
            above = []
        first = False
        per_field[name] = " ".join(above + inline).strip()
    return " ".join(section).strip(), per_field, annotations


def _yaml_value(value) -> str:
    import json

    import yaml

    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, allow_unicode=True).strip()
    return text[:-4].strip() if text.endswith("\n...") or text.endswith(" ...") else text.removesuffix("...").strip()


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _joined_text(node: ast.AST, namespace: Optional[dict] = None) -> str:
    """A string constant or f-string as text. A formatted field is evaluated in `namespace` when
    it names only module-level constants (`{KL_KINDS}` → `('k1', 'k2', 'k3')`), else it stands as
    `…` (a value known only at run time)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            elif isinstance(v, ast.FormattedValue):
                parts.append(_field_text(v.value, namespace))
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _joined_text(node.left, namespace) + _joined_text(node.right, namespace)
    if isinstance(node, ast.IfExp):
        return _joined_text(node.body, namespace) or _joined_text(node.orelse, namespace)
    return ""


def _field_text(expr: ast.AST, namespace: Optional[dict]) -> str:
    if namespace is None:
        return "{" + ast.unparse(expr) + "}"
    names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    safe = {"list": list, "sorted": sorted, "set": set, "tuple": tuple}
    if names and all(n in safe or (n in namespace and n.isupper()) for n in names):
        try:
            return str(eval(compile(ast.Expression(expr), "<check>", "eval"), {"__builtins__": safe}, namespace))
        except Exception:  # noqa: BLE001 — shown as a run-time value
            pass
    return "…"


def _check_calls(path: pathlib.Path, namespace: dict, callee: Tuple[str, ...], where_arg: int, want_arg: int):
    """(field, expected text) of each `callee(...)` call in `path` whose field is a literal."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in callee):
            continue
        if len(node.args) <= max(where_arg, want_arg):
            continue
        where = _joined_text(node.args[where_arg], namespace)
        want = _joined_text(node.args[want_arg], namespace).strip()
        if not where or where.startswith("…") or not want or want.startswith("…"):
            continue
        where = re.sub(r"\[…\]$", "", where)  # rewards.functions[{i}] → rewards.functions
        where = where.replace(".….", ".<name>.").removesuffix(".…")
        yield where, want


def _explicit_checks() -> Dict[str, List[str]]:
    """field path → the "expected …" texts of the loader's own checks (`_bad(path, value, want)`
    / `bad(...)` calls with a literal path) in the config package, and of the loss contract's
    checks (`bad(name, want)` in LossConfig) for the `algorithm.*` fields it receives."""
    import importlib

    import fastgrpo.config as config_pkg
    from fastgrpo.config import AlgorithmConfig

    out: Dict[str, List[str]] = {}

    def add(where, want):
        out.setdefault(where, [])
        if want not in out[where]:
            out[where].append(want)

    for path in sorted(pathlib.Path(config_pkg.__file__).parent.glob("*.py")):
        module = importlib.import_module(f"fastgrpo.config.{path.stem}") if path.stem != "__init__" else config_pkg
        for where, want in _check_calls(path, vars(module), ("_bad", "bad"), 0, 2):
            add(where, want)
    contract = importlib.import_module("fastgrpo.kernels.contract")
    algorithm = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    for where, want in _check_calls(pathlib.Path(contract.__file__), vars(contract), ("bad",), 0, 1):
        if where in algorithm:
            add(f"algorithm.{where}", want)
    return out


def _table_checks() -> Dict[str, List[str]]:
    """field path → "expected …" of the loader's table of range / choice checks."""
    from fastgrpo.config import load as loader

    out = {path: [want] for path, (_ok, want) in getattr(loader, "_CHECKS", {}).items()}
    for key, (_ok, want) in getattr(loader, "_MODEL_CHECKS", {}).items():
        out[f"rewards.models.<name>.{key}"] = [want]
    return out


def config_sections() -> List[ConfigSection]:
    """Every section of the run configuration, depth first, with every field."""
    from fastgrpo.config import TrainConfig

    from fastgrpo.config import check_reward_name

    checks = _table_checks()
    for path, wants in _explicit_checks().items():
        for w in wants:
            if w not in checks.setdefault(path, []):
                checks[path].append(w)
    names = check_reward_name("?")  # what the check says a reward name must be
    for path in ("rewards.functions", "rm_stage.functions"):
        checks.setdefault(path, []).insert(0, f"each {names} (or the name of a rewards.models entry)")
    sections: List[ConfigSection] = []

    def visit(cls, prefix: str):
        doc, comments, annotations = _class_comments(cls)
        section = ConfigSection(prefix, cls.__name__, doc)
        sections.append(section)
        hints = typing.get_type_hints(cls)
        nested = []
        for f in dataclasses.fields(cls):
            path = f"{prefix}.{f.name}" if prefix else f.name
            tp = hints[f.name]
            value = _default(f)
            if dataclasses.is_dataclass(tp):
                nested.append((tp, path))
                continue
            args = typing.get_args(tp)
            if typing.get_origin(tp) in (dict, Dict) and args and dataclasses.is_dataclass(args[1]):
                nested.append((args[1], f"{path}.<name>"))
            section.fields.append(ConfigField(path, f.name, annotations.get(f.name, str(tp)), _yaml_value(value),
                                              comments.get(f.name, ""), list(checks.get(path, []))))
        for tp, path in nested:
            visit(tp, path)

    visit(TrainConfig, "")
    return sections


def config_fields() -> List[ConfigField]:
    return [f for s in config_sections() for f in s.fields]


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


@dataclass
class CliOption:
    flags: str  # "--set A.B=VALUE" or "run" for a positional
    help: str
    default: str
    required: bool


@dataclass
class CliCommand:
    name: str  # "" for `fastgrpo` itself
    help: str
    epilog: str
    usage: str
    options: List[CliOption] = field(default_factory=list)


def _options(parser: argparse.ArgumentParser) -> List[CliOption]:
    out = []
    for a in parser._actions:
        if isinstance(a, (argparse._SubParsersAction, argparse._HelpAction)):
            continue
        if a.option_strings:
            flags = ", ".join(a.option_strings)
            if a.nargs != 0:
                flags += f" {a.metavar or a.dest.upper()}"
        else:
            flags = a.metavar or a.dest
        default = "" if a.default in (None, False, [], argparse.SUPPRESS) else repr(a.default)
        out.append(CliOption(flags, (a.help or "").replace("%(prog)s", parser.prog), default, bool(a.required)))
    return out


def cli_commands() -> List[CliCommand]:
    """`fastgrpo` and each subcommand, with every option, from `fastgrpo.cli.build_parser()`."""
    from fastgrpo.cli import build_parser

    parser = build_parser()
    commands = [CliCommand("", parser.description or "", parser.epilog or "", parser.format_usage().strip(),
                           _options(parser))]
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {c.dest: c.help or "" for c in action._choices_actions}
        for name, sub in action.choices.items():
            commands.append(CliCommand(name, helps.get(name, ""), sub.epilog or "", sub.format_usage().strip(),
                                       _options(sub)))
    return commands


def cli_flags() -> List[Tuple[str, str]]:
    """(command, option string) for every option of every command ("" = `fastgrpo` itself)."""
    return [(c.name, s.split(" ")[0].rstrip(",")) for c in cli_commands() for o in c.options
            for s in o.flags.split(", ")]


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------

# the namespaces of metrics.jsonl (and of TRL's log_history for fastgrpo/*)
METRIC_PREFIXES = ("train", "reward", "process", "timing", "async", "eval", "sft", "perf", "loss", "completion",
                   "curriculum", "episode", "fastgrpo", "clip_ratio", "rm_stage", "fusion")
_METRIC = re.compile(r"^(%s)/[A-Za-z0-9_@.:/*-]+$" % "|".join(METRIC_PREFIXES))
# any `namespace/name`: a literal of this shape used as a dict key or subscript is a metric too,
# whatever its namespace (so a new namespace cannot slip past the metrics page)
_KEYLIKE = re.compile(r"^[a-z][a-z_]*/[A-Za-z0-9_@.:/*-]+$")
_NOT_METRIC_SUFFIX = (".py", ".json", ".jsonl", ".yaml", ".yml", ".png", ".csv", ".md", ".txt", ".so", ".cpp")
_SOURCE_ROOTS = ("fastgrpo", "kernels")


@dataclass(frozen=True)
class MetricLiteral:
    name: str  # as written, f-string fields as {expr}
    file: str
    line: int


def _literal_text(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return _joined_text(node)
    return None


def _is_metric(text: str, keyed: bool = False) -> bool:
    w = _wild(text)
    shape = _KEYLIKE if keyed else _METRIC
    return bool(shape.match(w)) and not w.endswith("/") and not w.endswith(_NOT_METRIC_SUFFIX)


def _python_files(roots: Iterable[str] = _SOURCE_ROOTS) -> List[pathlib.Path]:
    return sorted(p for r in roots for p in (ROOT / r).rglob("*.py"))


def metric_literals(roots: Iterable[str] = _SOURCE_ROOTS) -> List[MetricLiteral]:
    """Every string literal or f-string of the source that reads as a metric name (a known
    namespace, a slash, no spaces), plus `timing/<phase>` for every `.phase("<phase>")` timer.
    An f-string inside another (`f"{a}/{b}"` nested) is taken whole, not by its pieces."""
    found = []
    for path in _python_files(roots):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        keys = {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys if k is not None}
        keys |= {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
        for node in ast.walk(tree):
            if id(node) in inner:
                continue
            text = _literal_text(node)
            if text is not None and _is_metric(text, keyed=id(node) in keys):
                found.append(MetricLiteral(text, rel, node.lineno))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "phase"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                found.append(MetricLiteral(f"timing/{node.args[0].value}", rel, node.lineno))
    return found


def _wild(name: str) -> str:
    """`reward/{name}/mean`, `reward/<name>/mean` and `reward/*/mean` → `reward/*/mean`; a
    format spec (`accuracy@{fraction:g}`) goes with its field."""
    return re.sub(r"\{[^{}]*\}|<[^<>]*>", "*", name)


def _matches(pattern: str, name: str) -> bool:
    """`*` stands for one or more characters within one path segment."""
    rx = "^" + ".+?".join(re.escape(p) for p in pattern.split("*")) + "$"
    return bool(re.match(rx, name)) and (pattern.count("/") == name.count("/") or "*" in pattern)


def metric_documented(name: str, documented: Iterable[str]) -> bool:
    """A metric literal is documented when the page names it: exactly, by a pattern of the same
    shape (`reward/{n}/failed` = `reward/<name>/failed`), or, for an f-string, by a documented
    concrete name it produces (`loss/{k}` is documented by `loss/kl_mean`)."""
    w = _wild(name)
    docs = [_wild(d) for d in documented]
    if w in docs:
        return True
    if w.endswith("_"):  # a prefix the code completes (`k.replace("sft/", "fusion/sft_")`)
        return any(d.startswith(w) for d in docs)
    if any("*" in d and _matches(d, w) for d in docs if "*" not in w):  # a concrete name under a pattern
        return True
    return "*" in w and any(fnmatch.fnmatchcase(d, w) and d.count("/") == w.count("/") for d in docs)


_DOC_METRIC = re.compile(r"`([a-z_]+/[^`\s]+)`")


def documented_metrics(markdown: str) -> List[str]:
    """The metric names of the metrics page: the backticked names in the first column of its tables."""
    out = []
    for line in markdown.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        first = re.split(r"(?<!\\)\|", line)[1]  # `\|` inside a cell is no column break
        out += [m for m in _DOC_METRIC.findall(first) if m.split("/")[0] in METRIC_PREFIXES]
    return out


# ---------------------------------------------------------------------------------------------
# exceptions
# ---------------------------------------------------------------------------------------------

@dataclass
class ErrorClass:
    name: str
    module: str  # dotted, as found (the page itself names only the class)
    bases: List[str]
    doc: str


def exception_classes(roots: Iterable[str] = _SOURCE_ROOTS) -> List[ErrorClass]:
    """Every public exception class the source defines (a class deriving from a built-in
    exception or from another of these), found with `ast`; private ones (`_Name`) stay internal."""
    import builtins

    builtin = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
               and issubclass(getattr(builtins, n), BaseException)}
    classes = []
    for path in _python_files(roots):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module.startswith("kernels"):
            module = "fastgrpo." + module
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                classes.append(ErrorClass(node.name, module, bases, (ast.get_docstring(node) or "").split("\n\n")[0]))
    names = set(builtin)
    errors: Dict[str, ErrorClass] = {}
    changed = True
    while changed:
        changed = False
        for c in classes:
            if c.name not in errors and any(b in names for b in c.bases):
                errors[c.name] = c
                names.add(c.name)
                changed = True
    return sorted((c for c in errors.values() if not c.name.startswith("_")), key=lambda c: c.name)


# ---------------------------------------------------------------------------------------------
# the public API (for mkdocstrings, found without importing: griffe reads the source)
# ---------------------------------------------------------------------------------------------


def _module_file(module: str) -> Optional[pathlib.Path]:
    parts = module.split(".")
    if parts[:2] == ["fastgrpo", "kernels"]:  # kernels/ is installed as fastgrpo.kernels
        parts = parts[1:]
    base = ROOT.joinpath(*parts)
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _defining_module(module: str, name: str, depth: int = 0) -> Optional[str]:
    """The module whose source defines `name`, following `from x import name` re-exports."""
    path = _module_file(module)
    if path is None or depth > 8:
        return None
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.name == name:
            return module
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            src = node.module or ""
            if node.level:  # relative import
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                src = ".".join(pkg[: len(pkg) - node.level + 1] + ([src] if src else []))
            real = next(a.name for a in node.names if (a.asname or a.name) == name)
            return _defining_module(src, real, depth + 1)
    for node in tree.body:  # a lazy export table (`_EXPORTS = {name: module}`, resolved by __getattr__)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            target = ast.literal_eval(node.value).get(name)
            if target and target != module:
                return _defining_module(target, name, depth + 1)
    if path.name == "__init__.py":  # `from .schema import *`: look in the star-imported modules
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) and node.module:
                found = _defining_module(node.module, name, depth + 1)
                if found:
                    return found
    return None


@dataclass
class ApiObject:
    name: str  # as imported: `from fastgrpo import <name>`
    exported_from: str  # the module `fastgrpo.<name>` loads it from
    defined_in: str  # the module whose source defines it
    identifier: str  # what mkdocstrings collects (griffe finds kernels/ as the package `kernels`)


def api_objects() -> List[ApiObject]:
    """Every name of `fastgrpo.__all__` (the lazy export table of fastgrpo/__init__.py)."""
    tree = ast.parse((ROOT / "fastgrpo" / "__init__.py").read_text())
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets))
    exports = ast.literal_eval(table)
    out = []
    for name, module in sorted(exports.items(), key=lambda kv: (kv[1], kv[0])):
        home = _defining_module(module, name) or module
        ident = f"{home}.{name}"
        if ident.startswith("fastgrpo.kernels."):
            ident = ident[len("fastgrpo."):]
        out.append(ApiObject(name, module, home, ident))
    return out


# ---------------------------------------------------------------------------------------------
# environment knobs (fastgrpo/env.py: every FASTGRPO_* variable is read there)
# ---------------------------------------------------------------------------------------------


def env_knobs() -> List[Tuple[str, str]]:
    """(variable, its accessor's docstring) for each FASTGRPO_* variable of fastgrpo/env.py."""
    tree = ast.parse((ROOT / "fastgrpo" / "env.py").read_text())
    out = []
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
            continue
        names = sorted({n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                        and re.fullmatch(r"FASTGRPO_[A-Z_]+", n.value)})
        for name in names:
            out.append((name, " ".join((ast.get_docstring(fn) or "").split())))
    return out
