"""Every example pair names the engine image that fits it: a pair on the flagcx transport or asking for GPUs names
the CUDA engine image (images/engine-cuda: vLLM for CUDA, libflagcx), every other pair the CPU engine image
(images/engine). The CPU image has neither CUDA nor libflagcx, so a GPU or FlagCX example on it fails at the pod's
start, which no other test would see. Cost: reads examples/*.yaml, under a second."""

from __future__ import annotations

import pathlib

import pytest
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
CUDA_IMAGE = "ghcr.io/pdpair/pdpair-engine-cuda:"
CPU_IMAGE = "ghcr.io/pdpair/pdpair-engine:"


def _pairs():
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferencePair":
                yield pytest.param(doc, id=f"{path.name}:{doc['metadata']['name']}")


def _asks_for_gpus(node) -> bool:
    if isinstance(node, dict):
        return any(key in ("limits", "requests") and isinstance(value, dict)
                   and any(str(name).startswith("nvidia.com/") for name in value)
                   or _asks_for_gpus(value) for key, value in node.items())
    if isinstance(node, list):
        return any(_asks_for_gpus(item) for item in node)
    return False


def test_examples_hold_pairs_of_both_kinds():
    pairs = [p.values[0] for p in _pairs()]
    kinds = {(p["spec"].get("connector", {}).get("transport") == "flagcx" or _asks_for_gpus(p["spec"])) for p in pairs}
    assert kinds == {True, False}, "the examples should show a CPU pair and a GPU/FlagCX pair"


@pytest.mark.parametrize("pair", list(_pairs()))
def test_an_example_names_the_image_of_its_transport_and_accelerator(pair):
    spec = pair["spec"]
    gpu_or_flagcx = spec.get("connector", {}).get("transport") == "flagcx" or _asks_for_gpus(spec)
    image = spec["image"]
    if gpu_or_flagcx:
        assert image.startswith(CUDA_IMAGE), f"a GPU or FlagCX pair needs the CUDA engine image, not {image}"
    else:
        assert image.startswith(CPU_IMAGE), f"a CPU pair runs the CPU engine image, not {image}"
