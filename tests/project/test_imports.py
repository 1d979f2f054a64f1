"""No import circle anywhere in gali_cli: the package's imports, read from its source with `ast`, form no cycle.

Every import counts, wherever it is written: at module level, inside a function (an import moved into a function to
dodge a circle is still one), and under `if TYPE_CHECKING:` (a type that only one side may name belongs to neither
side). An import of `package.module` is an edge to that module only; the package's `__init__` counts through its own
imports.
"""

import ast
from pathlib import Path

import pytest

import gali_cli

ROOT = Path(gali_cli.__file__).parent
PACKAGE = "gali_cli"


def module_names() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, from its `__init__.py`)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that the module `name` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from package import module` imports the module; `from module import name` the module alone.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as the modules along it (first one repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the walk's path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The layers, top first (docs/dev/architecture.md shows the same order): a module imports its own layer and those below
# it, never one above. Each entry names packages or modules under gali_cli; what no layer names is the base (config,
# errors, compat, the caches' ownership, printable...), which every layer may read and which reads none of them.
LAYERS = (
    ("the front", ("cli", "options", "exits", "entry", "__main__")),
    ("the runs", ("runs",)),
    ("the output", ("display", "tables", "plots")),
    ("the application", ("patching", "conversation", "document_states", "doc_cache", "generate", "perplexity",
                         "prompts", "documents", "estimate", "server", "evaluation", "repetition", "seam_check",
                         "loading", "gguf_weights")),
    ("the methods", ("methods",)),
    ("the engine's checks", ("engine.checks",)),
    ("the engine's seam", ("engine.seam",)),
    ("the contract", ("engine.contract",)),
    ("the attention routes", ("engine.attention",)),
    ("the kernels", ("engine.kernels",)),
    ("the engine's math", ("engine.math", "engine")),
    ("the model", ("model",)),
)
# Imports that run up the order, each declared here with the reason it must, until it goes. None today: an exception
# is added as a pair (importer, imported), and the test fails once the import is gone so the entry goes with it.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def layer_of(name: str) -> int:
    """The index of `name`'s layer in LAYERS (the base: len(LAYERS))."""
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(name == f"{PACKAGE}.{prefix}" or name.startswith(f"{PACKAGE}.{prefix}.") for prefix in prefixes):
            return index
    return len(LAYERS)


def test_no_import_runs_up_the_layers() -> None:
    graph = import_graph()
    upward = {(name, target) for name, targets in graph.items() for target in targets
              if layer_of(target) < layer_of(name)}
    new = sorted(upward - KNOWN_UPWARD)
    assert not new, "imports up the layers: " + ", ".join(
        f"{name} ({LAYERS[layer_of(name)][0] if layer_of(name) < len(LAYERS) else 'the base'}) -> {target} "
        f"({LAYERS[layer_of(target)][0]})" for name, target in new)
    assert not KNOWN_UPWARD - upward, f"gone, take them off KNOWN_UPWARD: {sorted(KNOWN_UPWARD - upward)}"
    base = sorted(name for name in graph if layer_of(name) == len(LAYERS) and name != PACKAGE)
    assert base, "the base holds the modules every layer reads"


def test_the_architecture_page_lists_the_layers_in_this_order() -> None:
    page = (ROOT.parent / "docs" / "dev" / "architecture.md").read_text()
    rows = [line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| the ")]
    assert rows == ["the front", "the runs", "the application", "the methods", "the engine", "the model"]


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
])
def test_find_cycle_names_the_cycle(graph: dict[str, set[str]], expected: list[str] | None) -> None:
    assert find_cycle(graph) == expected


def test_imports_inside_functions_and_type_checking_count(tmp_path: Path) -> None:
    source = tmp_path / "a.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n    from .c import Thing\n"
        "def late():\n    from .d import helper\n"
    )
    modules = {name: tmp_path / f"{name}.py" for name in ("p.a", "p.b", "p.c", "p.d", "p.e")}
    assert imported_modules("p.a", source, modules) == {"p.b", "p.c", "p.d"}


def test_methods_take_their_contract_from_one_module_and_never_reach_the_seam() -> None:
    """A method is written against engine/contract.py; installing it (hooks) and recording the decoding step are the
    seam's business, reached through gali_cli.patching."""
    graph = import_graph()
    methods = {name: targets for name, targets in graph.items() if name.startswith(f"{PACKAGE}.methods")}
    assert f"{PACKAGE}.methods.gali" in methods  # the walk found them
    for name, targets in methods.items():
        reached = sorted(target for target in targets if target.startswith(f"{PACKAGE}.engine.seam"))
        assert not reached, f"{name} imports {reached}"
        assert f"{PACKAGE}.engine.attention.choice" not in targets, f"{name} decides the attention plan itself"


def test_the_plan_is_decided_in_at_most_two_engine_modules() -> None:
    """Routes take the plan as an argument; only the forward's entry point (the contract's Forward) and the
    self-check decide it."""
    modules = module_names()
    callers = sorted(name for name, path in modules.items()
                     if name.startswith(f"{PACKAGE}.engine") and name != f"{PACKAGE}.engine.attention.choice"
                     and "plan_for(" in path.read_text())
    assert callers == [f"{PACKAGE}.engine.checks.self_check", f"{PACKAGE}.engine.contract"]
