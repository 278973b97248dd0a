"""The shape of the code base (issue 15): no import loops, small modules, no private Keras imports.

Static checks on the source (``ast``), the same on every backend.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_mone"
MAX_LINES = 400


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(("keras_mone",) + path.relative_to(PACKAGE).with_suffix("").parts)
        yield name.removesuffix(".__init__"), path


def imported_modules(name, path, known):
    """keras_mone modules ``path`` imports (at any level: a lazy import still couples two modules)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("keras_mone")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("keras_mone"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
    return {m for m in found if m != name}


def test_no_import_loops():
    paths = dict(modules())
    graph = {name: imported_modules(name, path, paths) for name, path in paths.items()}
    # a package's __init__ re-exporting its own modules is not a loop
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".") or m not in paths}
    loops = []
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                loops.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not loops, "import loops:\n" + "\n".join(" -> ".join(loop) for loop in loops)


@pytest.mark.parametrize("name, path", list(modules()), ids=[n for n, _ in modules()])
def test_module_is_small_and_imports_no_private_keras(name, path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{name} has {len(text.splitlines())} lines (at most {MAX_LINES})"
    assert "keras.src" not in text, f"{name} imports keras.src"
