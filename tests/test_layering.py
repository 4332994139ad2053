"""The package's imports run one way, down the layers below; no module imports itself back.

Every `import dflash_train...` counts, at module level or inside a function (a lazy import still
ties the two modules together), and so does every relative import (`from .x import y`). A new folder or top-level module must be given its place in LAYERS.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_train"

LAYERS = [
    {"__init__", "pinned_memory", "device_clock", "errors", "disk", "atomic", "run_lock", "package_data", "config",
     "config_model", "config_training", "families", "config_loader", "config_flags", "checks", "compiled_steps"},
    {"data"},
    {"targets"},
    {"draft"},
    {"checkpoint"},
    {"decode"},
    {"generate", "eval"},
    {"serve"},
    {"train"},
    {"distributed"},
    {"quickstart"},
    {"cli", "cli_args", "cli_commands", "__main__"},
]
"""Bottom to top, in the order the data flows: a unit imports units of lower layers, and of its own
layer where no circle forms. `decode` (every decoder) sits above the target and the drafter;
`generate` answers prompts with it and `eval` measures it, and the two never import each other."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    """The module a `from ... import` names, relative imports resolved against the file's package."""
    if node.level == 0:
        return node.module
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "dflash_train" or n.startswith("dflash_train.")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # `from pkg import mod` names a module; `from mod import func` names the module it is in
        graph[name] = {n for n in _imports(path) if n in modules} - {name}
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_back():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_every_import_runs_down_the_layers():
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    graph = _graph()
    unplaced = sorted({_unit(m) for m in graph} - set(rank))
    assert not unplaced, f"give {unplaced} a layer in LAYERS"
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if rank[_unit(b)] > rank[_unit(a)])
    assert not upward, "imports that run up:\n" + "\n".join(upward)


def test_generate_and_eval_do_not_import_each_other():
    crossing = sorted(f"{a} -> {b}" for a, targets in _graph().items() for b in targets
                      if {_unit(a), _unit(b)} == {"generate", "eval"})
    assert not crossing, "generate and eval import each other:\n" + "\n".join(crossing)


def test_relative_imports_count(tmp_path):
    """`from ..eval import report` in generate/ names eval.report, as its absolute form would."""
    module = tmp_path / "dflash_train" / "generate" / "job.py"
    module.parent.mkdir(parents=True)
    module.write_text("from ..eval import report\nfrom .shards import Shard\nfrom . import backends\n")
    package = tmp_path / "dflash_train" / "generate" / "__init__.py"
    package.write_text("from .job import run\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "dflash_train"
    try:
        assert _imports(module) >= {"dflash_train.eval", "dflash_train.eval.report", "dflash_train.generate.shards",
                                    "dflash_train.generate.backends"}
        assert "dflash_train.generate.job" in _imports(package)
    finally:
        PACKAGE = saved


def test_the_checks_find_what_they_guard_against():
    """A circle and an upward import planted in a copy of the graph are found."""
    graph = _graph()
    graph["dflash_train.data.formats"] = graph["dflash_train.data.formats"] | {"dflash_train.eval.report"}
    graph["dflash_train.eval.report"] = graph["dflash_train.eval.report"] | {"dflash_train.data.formats"}
    assert _cycle(graph) is not None
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    assert rank[_unit("dflash_train.eval.report")] > rank[_unit("dflash_train.data.formats")]
