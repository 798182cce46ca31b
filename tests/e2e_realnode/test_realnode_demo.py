"""The README's main command (`bash hack/demo.sh`) runs this code on the real nodes: hack/demo_realnode.py's
`show_pair_and_single`, here on the test session's cluster and operator (the demo's own part before it, building a
cluster and `helm install`, is what this package's fixtures do). The pair is applied and timed to its first answer
through its Service, then one engine pod without a connector on the same node, and the demo prints both answers,
says whether they are equal and says the tiny model's words are nonsense by design (random weights).

Cost: 3 vLLM cold starts (the pair's two at once, then the single engine's), about 60-80 s on a quiet box.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re

from pdpair.contract import LABEL_PAIR
from devcluster.product import ENGINE_START_TIMEOUT

DEMO = pathlib.Path(__file__).resolve().parents[2] / "hack" / "demo_realnode.py"


def load_demo():
    spec = importlib.util.spec_from_file_location("demo_realnode", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_shows_the_pair_beside_a_single_engine_and_their_equal_answers(
        real_cluster, operator_release, images, model_dir, namespace):
    demo = load_demo()
    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(text)
        print(f"[realnode-e2e] demo: {text}", flush=True)

    rc = demo.show_pair_and_single(real_cluster, images["engine"].ref, model_dir, say, 2 * ENGINE_START_TIMEOUT,
                                   namespace=namespace)
    text = "\n".join(lines)
    assert rc == 0, text
    assert "the pair's answer EQUALS the single engine's" in text, text
    pair_s = float(re.search(r"pair: first answer ([\d.]+)s after kubectl apply", text).group(1))
    single_s = float(re.search(r"single engine: first answer ([\d.]+)s after kubectl apply", text).group(1))
    assert 0 < single_s and 0 < pair_s, text
    assert "weights are random" in text  # a newcomer is told why the words are nonsense
    # The timeline shows every pod of the pair and the single engine coming and going.
    for role in ("decode", "prefill", "router", "single engine, no connector"):
        assert f"({role}) created" in text and f"({role}) Ready on node" in text, (role, text)
    assert re.search(r"pair phase Ready: generation 1 is ready", text), text
    left = real_cluster.kubectl("get", "pods", "-n", namespace, "-l", f"{LABEL_PAIR}={demo.PAIR}", "-o", "name").stdout
    assert not left.strip() and demo.SINGLE not in real_cluster.kubectl("get", "pods", "-n", namespace,
                                                                        "-o", "name").stdout, left
