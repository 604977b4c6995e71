"""The package's shape, read from its code: no import circles, engines that never import each other,
layers below the engines that import none, and modules readable in one sitting."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fedcontrast"
ENGINES = ("fedcontrast.sim", "fedcontrast.openfl", "fedcontrast.flower")  # one folder per engine: only the adapter
# Layers every engine uses: they import no engine (and no engine's library).
BELOW_ENGINES = ("fedcontrast.algorithms", "fedcontrast.aggregation", "fedcontrast.config", "fedcontrast.construction",
                 "fedcontrast.data", "fedcontrast.deploy", "fedcontrast.devices", "fedcontrast.evaluation",
                 "fedcontrast.losses", "fedcontrast.models", "fedcontrast.outputs", "fedcontrast.privacy",
                 "fedcontrast.robust", "fedcontrast.rounds", "fedcontrast.site")
# (engine, a library only that engine imports): the simulator's executors run on Ray and on Flower
ENGINE_LIBRARIES = [("fedcontrast.openfl", "openfl"), ("fedcontrast.sim", "ray"), ("fedcontrast.sim", "flwr"),
                    ("fedcontrast.flower", "flwr")]
MAX_LINES = 420  # "about 400"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of the package ``name`` imports (at any depth of its code, not under
    ``TYPE_CHECKING``), with the packages whose ``__init__`` an import runs on the way."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # a.b.c runs a/__init__, a/b/__init__, then a/b/c
                candidate = ".".join(parts[:i])
                # a package that holds the importer is initialised before it anyway: no edge
                if candidate in known and candidate != name and not name.startswith(candidate + "."):
                    found.add(candidate)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _within(name: str, packages) -> str | None:
    return next((p for p in packages if name == p or name.startswith(p + ".")), None)


def test_the_checker_finds_a_circle_and_an_engine_importing_another():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == [["a", "b", "c"]]
    tree = {"fedcontrast.sim.x": {"fedcontrast.openfl.y"}}
    assert engine_crossings(tree) == ["fedcontrast.sim.x imports fedcontrast.openfl.y"]


def engine_crossings(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for source, targets in edges.items():
        mine = _within(source, ENGINES)
        for target in sorted(targets):
            theirs = _within(target, ENGINES)
            if theirs is not None and mine is not None and theirs != mine:
                out.append(f"{source} imports {target}")
    return out


def test_there_is_no_import_circle():
    found = circles(graph())
    assert found == [], "import circles: " + "; ".join(" → ".join(c) for c in found)


def test_engines_never_import_each_other():
    assert engine_crossings(graph()) == []


def test_the_layers_below_the_engines_import_no_engine():
    edges = graph()
    bad = [f"{source} imports {target}" for source, targets in edges.items() if _within(source, BELOW_ENGINES)
           for target in sorted(targets) if _within(target, ENGINES)]
    assert bad == []


@pytest.mark.parametrize("engine,library", ENGINE_LIBRARIES)
def test_only_its_engine_imports_an_engine_library(engine, library):
    bad = []
    for name, path in modules().items():
        if _within(name, BELOW_ENGINES):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                bad += [f"{name} imports {m}" for m in mods if m == library or m.startswith(library + ".")]
    assert bad == []


def test_every_module_reads_in_one_sitting():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


def layer_order() -> list[str]:
    """The package's top-level modules and folders in the order docs/layout.md lists them."""
    import re

    text = (PACKAGE.parents[1] / "docs" / "layout.md").read_text()
    block = text[text.index("src/fedcontrast/"):text.index("src/_fedcontrast_fx_guard.py")]
    order: list[str] = []
    for line in block.splitlines():
        head = re.match(r"  ([a-z_][a-z_0-9]*)(/|\.py)", line)
        if not head:
            continue
        first = line.split("   ")[0]  # the names column: one folder or module, or several modules
        names = re.findall(r"([a-z_][a-z_0-9]*)\.py", first) if head.group(2) == ".py" else [head.group(1)]
        order += [n for n in names if n not in order]
    return order


def test_every_import_points_up_the_layers_of_docs_layout():
    """Each module imports only what docs/layout.md lists above its own folder (or its own folder),
    function-level imports included, TYPE_CHECKING ones not: the layers hold as documented."""
    order = layer_order()
    rank = {name: i for i, name in enumerate(order)}
    tops = {name.split(".")[1] for name in modules() if "." in name}
    assert tops <= set(rank), f"docs/layout.md does not list {sorted(tops - set(rank))}"
    upward = sorted((a, b) for a, targets in graph().items() if "." in a for b in targets if "." in b
                    and rank[b.split(".")[1]] > rank[a.split(".")[1]])
    assert upward == [], f"imports of a layer listed below the importer in docs/layout.md: {upward}"
