"""The package layout of DESIGN.md ("Layout"): every module imports on its own, module-level
imports form no cycle, and imports flow one way between the folders (a folder imports only
from folders above it in LAYERS, function-level imports included)."""
import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# top to bottom: a module may import from its own layer and the layers above it
LAYERS = [
    ("fastgrpo.env", "fastgrpo.kernels", "fastgrpo.config"),
    ("fastgrpo.native",),
    ("fastgrpo.loss",),
    ("fastgrpo.packing",),
    ("fastgrpo.advantages", "fastgrpo.curriculum", "fastgrpo.correction"),
    ("fastgrpo.rewards",),
    ("fastgrpo.tasks",),
    ("fastgrpo.episodes",),
    ("fastgrpo.models",),
    ("fastgrpo.sync",),
    ("fastgrpo.rollout",),
    ("fastgrpo.workers",),
    ("fastgrpo.runs",),
    ("fastgrpo.logs",),
    ("fastgrpo.trainer",),
    ("fastgrpo.recipes",),
    ("fastgrpo.pipeline",),
    ("fastgrpo.integrations",),
    ("fastgrpo.demo",),
    ("fastgrpo.cli",),
]


def _modules():
    """{module name: path} of every module of fastgrpo/ and kernels/ (= fastgrpo.kernels)."""
    out = {}
    for base, pkg in ((ROOT / "fastgrpo", "fastgrpo"), (ROOT / "kernels", "fastgrpo.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = path
    return out


MODULES = _modules()


def _layer(mod: str) -> int:
    if mod == "fastgrpo":
        return -1
    for i, prefixes in enumerate(LAYERS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{mod} is in no layer of LAYERS: add its folder")


def _imports(mod: str, path: pathlib.Path):
    """(imported fastgrpo module, line, module level?) for every import statement of `path`."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:  # `from pkg import submodule` imports the submodule
                names.append(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("fastgrpo") and name != mod:
                yield name, node.lineno, id(node) in top


def test_every_module_is_in_a_layer_and_imports_flow_one_way():
    bad = []
    for mod, path in MODULES.items():
        for dep, line, _ in _imports(mod, path):
            if _layer(dep) > _layer(mod):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {mod} imports {dep}, a folder below it")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_at_module_level():
    graph = {m: {d for d, _, top in _imports(m, p) if top} for m, p in MODULES.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_private_name_crosses_modules():
    """`from a import _name` between fastgrpo modules is a reach-in: a shared helper gets a public
    name in the module that owns it."""
    bad = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fastgrpo"):
                for a in node.names:
                    compiled = f"{node.module}.{a.name}" == "fastgrpo._C"  # the pybind11 extension
                    if a.name.startswith("_") and f"{node.module}.{a.name}" not in MODULES and not compiled:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {a.name} from {node.module}")
    assert not bad, "\n".join(bad)


def test_every_module_imports_in_a_fresh_interpreter():
    """Each module imported first, with no other fastgrpo module loaded before it (third-party
    modules stay cached, so this takes seconds, not minutes): an order-dependent import cycle fails."""
    code = """
import importlib, sys, traceback, warnings
warnings.simplefilter("ignore")
failed = []
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m == "fastgrpo" or m.startswith("fastgrpo.")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""
    # trl / vllm / deepspeed / triton-only modules import only with their packages installed
    mods = [m for m in MODULES if not m.endswith("__main__")]
    out = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, timeout=600,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def _rooms():
    """{folder of fastgrpo/ (sub-folders count as their own room): (lines, modules)}."""
    out = {}
    for path in (ROOT / "fastgrpo").rglob("*.py"):
        room = path.parent.relative_to(ROOT / "fastgrpo").as_posix()
        if room == ".":
            continue
        lines, mods = out.get(room, (0, 0))
        out[room] = (lines + len(path.read_text().splitlines()), mods + 1)
    return out


def test_no_room_outgrows_its_name():
    """A folder holding several concepts is split before the next capability lands in it (issue
    32: trainer/ had 25 % of fastgrpo/'s lines in 23 modules): no folder over ~15 % of the lines
    (16 % with rounding slack) or 16 modules (its __init__ included)."""
    rooms = _rooms()
    total = sum(lines for lines, _ in rooms.values()) + sum(
        len(p.read_text().splitlines()) for p in (ROOT / "fastgrpo").glob("*.py"))
    big = [f"fastgrpo/{r}: {lines} lines ({100 * lines / total:.1f} %), {mods} modules"
           for r, (lines, mods) in sorted(rooms.items()) if lines > 0.16 * total or mods > 16]
    assert not big, "split these rooms:\n" + "\n".join(big)


def test_tests_mirror_the_rooms():
    """Every top-level room of fastgrpo/ has its tests in tests/<room>/, and every test folder
    names a room (or kernels/): a newcomer finds a room's tests in one hop."""
    rooms = {p.name for p in (ROOT / "fastgrpo").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    test_dirs = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    missing = sorted(r for r in rooms if r not in test_dirs)
    stray = sorted(d for d in test_dirs if d not in rooms | {"kernels"})
    assert not missing, f"rooms without a tests/<room>/ folder: {missing}"
    assert not stray, f"test folders that name no room of fastgrpo/: {stray}"
