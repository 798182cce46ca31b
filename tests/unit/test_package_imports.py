"""The arrows between pdpair's packages, read from the one source tree (src/pdpair), as src/README.md draws them:
the shared layer (contract, httpserver) imports no other pdpair package, the operator and the connector never
import each other, and no two packages import each other. Pure ast over the source; costs well under a second."""

import ast
import pathlib
from graphlib import CycleError, TopologicalSorter

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "pdpair"
SHARED = {"contract", "httpserver"}


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pdpair" else None


def package_imports() -> dict[str, set[str]]:
    """Each pdpair package -> the other pdpair packages its modules import, at any depth of the code."""
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    edges: dict[str, set[str]] = {name: set() for name in packages}
    for name in packages:
        for path in (SRC / name).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                edges[name].update(t for t in map(_package_of, targets) if t in packages)
        edges[name].discard(name)
    return edges


def test_every_package_of_the_source_tree_is_seen():
    edges = package_imports()
    assert {"contract", "httpserver", "operator", "connector", "router", "native"} <= set(edges)
    # arrows that exist today, so a broken parser cannot pass the tests below with an empty graph
    assert "contract" in edges["operator"] and "contract" in edges["connector"] and "native" in edges["connector"]


def test_shared_layer_imports_no_product_package():
    edges = package_imports()
    for name in SHARED:
        assert edges[name] <= SHARED, f"pdpair.{name} is shared and must not import {sorted(edges[name] - SHARED)}"


def test_operator_and_connector_never_import_each_other():
    edges = package_imports()
    assert not edges["operator"] & {"connector", "router", "native"}, edges["operator"]
    assert "operator" not in edges["connector"] and "operator" not in edges["router"]


def test_no_circle_between_packages():
    try:
        list(TopologicalSorter(package_imports()).static_order())
    except CycleError as circle:
        raise AssertionError(f"import circle between pdpair packages: {' -> '.join(circle.args[1])}") from None
