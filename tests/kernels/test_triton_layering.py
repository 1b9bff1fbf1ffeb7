"""The Triton backend's modules import one another one way only (kernels/triton/: `_common` is the
leaf, `_tune` builds on it, the kernels on both): an import cycle, even one hidden inside a
function (`_common` ↔ `_tune` once was), makes the import order matter and the layering unreadable.
Read from the sources, so nothing is imported."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "triton"
PREFIX = "fastgrpo.kernels.triton"


def _graph():
    mods = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((PKG / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == PREFIX:
                    deps |= {a.name for a in node.names if a.name in mods}
                elif node.module.startswith(PREFIX + "."):
                    deps.add(node.module[len(PREFIX) + 1:].split(".")[0])
            elif isinstance(node, ast.Import):
                deps |= {a.name[len(PREFIX) + 1:].split(".")[0] for a in node.names if a.name.startswith(PREFIX + ".")}
        graph[m] = deps & mods - {m}
    return graph


def _cycle(graph):
    state = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path + [m, d]
            if d not in state:
                found = visit(d, path + [m])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [])
            if found:
                return found
    return None


def test_no_import_cycle_in_the_triton_backend():
    graph = _graph()
    assert "_common" in graph and "_tune" in graph["grpo_loss"], graph  # the reader sees the imports
    assert not graph["_common"], f"_common must be the leaf; it imports {graph['_common']}"
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"a"}}) in (["a", "b", "a"], ["b", "a", "b"])
