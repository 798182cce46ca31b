"""The operator image needs no connector code: importing every operator module loads nothing of pdpair.connector
(nor vllm/torch). A subprocess, so other tests' imports do not hide a new dependency."""

import json
import pkgutil
import subprocess
import sys

import pdpair.operator


def test_operator_modules_do_not_import_the_connector():
    modules = [f"pdpair.operator.{m.name}" for m in pkgutil.iter_modules(pdpair.operator.__path__)
               if m.name != "__main__"]
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('pdpair.connector', 'vllm', 'torch')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert "pdpair.operator.handlers" in modules and "pdpair.operator.metrics" in modules


def _operator_imports() -> dict[str, set[str]]:
    """Each operator module -> the operator modules it imports, at any depth of its code (a function-level import
    is still an edge of the circle)."""
    import ast
    import pathlib

    folder = pathlib.Path(pdpair.operator.__path__[0])
    names = {p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
    edges: dict[str, set[str]] = {}
    for name in names:
        tree = ast.parse((folder / f"{name}.py").read_text())
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:  # from .x import y
                    found.add(node.module.split(".")[0])
                elif node.level == 1:  # from . import x, y
                    found.update(a.name for a in node.names)
                elif node.module and node.module.startswith("pdpair.operator."):
                    found.add(node.module.split(".")[2])
                elif node.module == "pdpair.operator":
                    found.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("pdpair.operator."))
        edges[name] = (found & names) - {name}
    return edges


def test_operator_modules_import_each_other_without_a_circle():
    """desired.py (Recreate) and rollout.py (Surge) once imported each other; planner.next_step now picks between
    them. A topological sort of the import graph fails on any circle and names it."""
    from graphlib import CycleError, TopologicalSorter

    edges = _operator_imports()
    assert "rollout" in edges["planner"] and "desired" in edges["rollout"] and not edges["desired"] & {"rollout", "planner"}
    try:
        list(TopologicalSorter(edges).static_order())
    except CycleError as circle:
        raise AssertionError(f"import circle among operator modules: {' -> '.join(circle.args[1])}") from None


DECISION_MODULES = ("planner", "leases", "desired", "rollout", "restart_policy", "busy_ports", "nodes", "health",
                    "observed")
EXECUTOR_MODULES = ("reconciler", "handlers", "scrape", "api", "election", "metrics", "__main__")


def test_decision_modules_load_no_client_and_no_executor():
    """The planner and everything it decides with are pure: importing them loads no kopf, no kubernetes client, no
    HTTP client (the health scrape's aiohttp lives in scrape.py), and no executor module. A subprocess, so the
    test's own imports do not hide a new dependency."""
    modules = [f"pdpair.operator.{m}" for m in DECISION_MODULES]
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted({m.split('.')[0] if not m.startswith('pdpair.') else m for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not loaded & {"kopf", "kubernetes", "aiohttp", "httpx", "urllib3"}, sorted(loaded)
    assert not loaded & {f"pdpair.operator.{m}" for m in EXECUTOR_MODULES}, sorted(loaded)
    assert set(modules) <= loaded


def test_no_decision_module_imports_an_executor_module():
    edges = _operator_imports()
    for name in DECISION_MODULES:
        assert not edges[name] & set(EXECUTOR_MODULES), f"{name} imports {sorted(edges[name] & set(EXECUTOR_MODULES))}"
