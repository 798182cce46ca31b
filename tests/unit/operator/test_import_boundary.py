"""The operator's layers, drawn from its own source: `model/` (settings, spec fields, what a pass observed,
conditions) < `decide/` (the pure rules) < `build/` (manifests) < `act/` (the executor: API calls, leases, pushes,
probes) < `glue/` (kopf and the process) < `__main__`. A module imports only its own layer and the layers below;
the module graph has no circle; the decisions load no client. Costs about 10 s (two subprocess imports)."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter

import pdpair.operator

PACKAGE = "pdpair.operator"
FOLDER = pathlib.Path(pdpair.operator.__path__[0])
LAYERS = ("model", "decide", "build", "act", "glue")


def _modules() -> dict[str, pathlib.Path]:
    """Every operator module by dotted name (packages' __init__ included under the package's name)."""
    found = {}
    for path in FOLDER.rglob("*.py"):
        parts = list(path.relative_to(FOLDER).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([PACKAGE, *parts])] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The operator modules `name` imports, at any depth of its code (a function-level import is an edge too)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            if target in modules and target != name:
                found.add(target)
    # a submodule's import of its own package's __init__ is no edge of interest
    return {m for m in found if m not in (PACKAGE, package) or m == name}


def layer_of(name: str) -> int:
    parts = name.split(".")
    if len(parts) < 3:
        return -1  # the package itself
    if parts[2] == "__main__":
        return len(LAYERS)
    assert parts[2] in LAYERS, f"{name} is in no layer: put it in one of {LAYERS}"
    return LAYERS.index(parts[2])


def operator_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_sits_in_a_layer():
    loose = sorted(p.name for p in FOLDER.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert not loose, f"operator modules outside the layer folders {LAYERS}: {loose}"
    for name in operator_graph():
        layer_of(name)


def test_no_import_from_a_lower_layer_into_a_higher_one():
    upward = sorted(f"{name} -> {target}" for name, targets in operator_graph().items() for target in targets
                    if layer_of(target) > layer_of(name))
    assert not upward, "imports into a higher layer:\n" + "\n".join(upward)


def test_operator_modules_import_each_other_without_a_circle():
    """recreate.py (Recreate) and surge.py (Surge) once imported each other; planner.next_step picks between them. A
    topological sort of the import graph fails on any circle and names it."""
    graph = operator_graph()
    assert f"{PACKAGE}.decide.surge" in graph[f"{PACKAGE}.decide.planner"]
    assert f"{PACKAGE}.decide.recreate" in graph[f"{PACKAGE}.decide.surge"]
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as circle:
        raise AssertionError(f"import circle among operator modules: {' -> '.join(circle.args[1])}") from None


def _loaded_after_importing(modules: list[str]) -> set[str]:
    """Every module loaded once `modules` are imported, in a fresh interpreter (the test's own imports would hide a
    new dependency)."""
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_operator_modules_do_not_import_the_connector():
    """The operator image needs no connector code: importing every operator module loads nothing of
    pdpair.connector (nor vllm/torch)."""
    modules = sorted(name for name in operator_graph() if not name.endswith("__main__"))
    loaded = _loaded_after_importing(modules)
    assert not {m for m in loaded if m.startswith(("pdpair.connector", "vllm", "torch"))}
    assert f"{PACKAGE}.glue.handlers" in modules and f"{PACKAGE}.act.metrics" in modules


def test_decisions_and_manifests_load_no_client_and_no_executor():
    """The planner, everything it decides with, and the manifests are pure: importing them loads no kopf, no
    kubernetes client, no HTTP client (the health scrape's aiohttp lives in act/scrape.py), and nothing of act/ or
    glue/."""
    pure = sorted(name for name in operator_graph() if layer_of(name) in (0, 1, 2))
    loaded = _loaded_after_importing(pure)
    top = {m.split(".")[0] for m in loaded}
    assert not top & {"kopf", "kubernetes", "aiohttp", "httpx", "urllib3"}, sorted(top)
    executor = {m for m in loaded if m.startswith((f"{PACKAGE}.act", f"{PACKAGE}.glue"))}
    assert not executor, sorted(executor)
    assert f"{PACKAGE}.decide.planner" in pure and f"{PACKAGE}.build.pods" in pure
