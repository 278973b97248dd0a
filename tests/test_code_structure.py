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


#: The library's floors, bottom up (issue 41): a package imports only packages
#: on lower floors, whether at the top of a file or inside a function (a lazy
#: import couples two packages all the same), and through a package's
#: ``__init__`` too. Top-level modules are named without the package prefix;
#: ``""`` is ``keras_mone/__init__`` (the facade over the library);
#: ``recipe_files`` is the folder of bundled recipe TOML files.
FLOORS = {
    "arguments": 0, "version": 0, "overrides": 0, "file_io": 0, "backend_choice": 0, "host_memory": 0, "exports": 0,
    "recipe_files": 0,
    "routing": 1,        # EPR, capacities, token groups: plain functions on tensors
    "kernels": 1,        # backend kernels (Pallas) beside the plain paths they equal
    "layers": 2,         # Keras layers: nested dense, attention, MLPs, routers, ACM, Mixer
    "models": 3,         # backbones and task classes
    "analysis": 4, "convert": 4, "data": 4,  # what reads models: FLOPs and analyses, checkpoints, inputs
    "training": 5,       # losses, modes, callbacks, checkpoints
    "methods": 6,        # the registry and one folder per method family (methods/<family>/)
    "presets": 7,        # named models and their weights
    "recipes": 8, "": 8,  # training runs from presets; the package facade
    "bench": 9,          # the benchmark (an application: builds presets and times them)
    "cli": 10,           # the keras-mone command, the quickstart, model cards
}


def _room(module):
    return module.split(".")[1] if "." in module else ""


def _package_edges():
    """``{(importing room, imported room): [importing modules]}`` over every import statement."""
    paths = dict(modules())
    edges = {}
    for name, path in paths.items():
        for imported in imported_modules(name, path, paths):
            pair = (_room(name), _room(imported))
            if pair[0] != pair[1]:
                edges.setdefault(pair, []).append(name)
    return edges


def test_every_package_has_a_floor():
    rooms = {_room(name) for name, _ in modules()}
    assert rooms <= set(FLOORS), f"packages without a floor in FLOORS: {sorted(rooms - set(FLOORS))}"


def test_packages_import_only_lower_floors():
    # Rules out what issue 41 found: models <-> training, routing <-> layers,
    # presets <-> recipes, presets <-> analysis, a ten-file circle through
    # data, presets and recipes, and applications (the quickstart) inside the
    # library; a same-floor pair in both directions is a circle too.
    upward = {
        pair: sorted(importers) for pair, importers in _package_edges().items()
        if FLOORS[pair[1]] >= FLOORS[pair[0]]
    }
    assert not upward, "imports that do not point down a floor:\n" + "\n".join(
        f"{a or 'keras_mone'} -> {b or 'keras_mone'}: {', '.join(m)}" for (a, b), m in sorted(upward.items())
    )


@pytest.mark.parametrize("name, path", list(modules()), ids=[n for n, _ in modules()])
def test_module_is_small_and_imports_no_private_keras(name, path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{name} has {len(text.splitlines())} lines (at most {MAX_LINES})"
    assert "keras.src" not in text, f"{name} imports keras.src"


MAX_FUNCTION_LINES = 80


def _functions(tree, prefix=""):
    """``(qualified name, def line, length in lines)`` of every function in ``tree``, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.lineno, node.end_lineno - node.lineno + 1  # lineno: the def, not a decorator
            yield from _functions(node, f"{prefix}{node.name}.<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def test_no_long_functions_or_modules():
    # Issue 41: no library function over 80 lines (counted from `def` to its
    # last line, decorators excluded), no module over 400 lines.
    too_long = []
    for name, path in modules():
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES:
            too_long.append(f"module {name}: {len(text.splitlines())} lines (at most {MAX_LINES})")
        for function, line, length in _functions(ast.parse(text)):
            if length > MAX_FUNCTION_LINES:
                too_long.append(
                    f"function {name}.{function} ({path.relative_to(PACKAGE.parent)}:{line}): "
                    f"{length} lines (at most {MAX_FUNCTION_LINES})"
                )
    assert not too_long, "too long:\n" + "\n".join(too_long)


def test_every_package_is_in_the_wheel():
    # pyproject lists its packages by name: a sub-package missing there (a new
    # method family's folder) imports from an editable install but is left
    # out of a built wheel (keras_mone.convert and data.augment once were).
    import tomllib

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(PACKAGE.parent).parts) for init in PACKAGE.rglob("__init__.py")}
    assert on_disk - listed == set(), f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
