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
