"""kwok, the fake kubelet of LocalCluster: which nodes it manages, the pod CIDR it hands out and its Stage configs
(nodes Ready with heartbeats; pods Running and Ready, or never Ready with NEVER_READY_LABEL; deleted pods removed)."""
from __future__ import annotations

# kwok manages only nodes carrying this label, so a Node created by hand (or by another tool) is left alone.
FAKE_NODE_LABEL = ("localcluster.pdpair.io/fake-node", "kwok")
# A pod carrying this label runs but never becomes Ready (a model that never finishes loading): kwok plays no
# probes, so tests that need a not-ready container set it in the pod template.
NEVER_READY_LABEL = ("localcluster.pdpair.io/readiness", "never")
POD_CIDR = "10.244.0.0/16"  # kwok hands out pod IPs from here for pods without hostNetwork


def _node_stage_configs() -> list[dict]:
    """kwok Stage configs: nodes become Ready and keep heartbeating; pods go Running/Ready and are removed when
    deleted. Templates keep any addresses/capacity already on the Node, so add_node() decides the InternalIP."""
    node_status = """\
{{ $now := Now }}
conditions:
{{ range NodeConditions }}
- type: {{ .type | Quote }}
  status: {{ .status | Quote }}
  reason: {{ .reason | Quote }}
  message: {{ .message | Quote }}
  lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
{{ if not .status.addresses }}
addresses:
- type: InternalIP
  address: {{ NodeIP | Quote }}
- type: Hostname
  address: {{ NodeName | Quote }}
{{ end }}
{{ if not .status.capacity }}
capacity: {cpu: "64", memory: 512Gi, pods: "110"}
{{ end }}
{{ if not .status.allocatable }}
allocatable: {cpu: "64", memory: 512Gi, pods: "110"}
{{ end }}
nodeInfo:
  architecture: amd64
  operatingSystem: linux
  kubeletVersion: {{ printf "kwok-%s" Version | Quote }}
  containerRuntimeVersion: fake
  kernelVersion: fake
  kubeProxyVersion: fake
  osImage: fake
  bootID: ""
  machineID: ""
  systemUUID: ""
phase: Running
"""
    heartbeat_status = """\
{{ $now := Now }}
conditions:
{{ range NodeConditions }}
- type: {{ .type | Quote }}
  status: {{ .status | Quote }}
  reason: {{ .reason | Quote }}
  message: {{ .message | Quote }}
  lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $.metadata.creationTimestamp | Quote }}
{{ end }}
"""
    pod_running_status = """\
{{ $now := Now }}
phase: Running
startTime: {{ $now | Quote }}
conditions:
{{ range list "Initialized" "PodScheduled" }}
- type: {{ . }}
  status: "True"
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
{{ range list "ContainersReady" "Ready" }}
- type: {{ . }}
  status: "@READY@"
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
{{ range .spec.readinessGates }}
- type: {{ .conditionType | Quote }}
  status: "True"
  lastTransitionTime: {{ $now | Quote }}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  imageID: ""
  ready: @ready@
  started: true
  restartCount: 0
  state: {running: {startedAt: {{ $now | Quote }}}}
{{ end }}
{{ with .spec.initContainers }}
initContainerStatuses:
{{ range . }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  imageID: ""
  ready: true
  restartCount: 0
  state: {terminated: {exitCode: 0, reason: Completed, startedAt: {{ $now | Quote }}, finishedAt: {{ $now | Quote }}}}
{{ end }}
{{ end }}
{{ with NodeIPsWith .spec.nodeName }}
hostIP: {{ index . 0 | Quote }}
hostIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
{{ with PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
podIP: {{ index . 0 | Quote }}
podIPs:
{{ range . }}
- ip: {{ . | Quote }}
{{ end }}
{{ end }}
"""

    def stage(name: str, kind: str, match: list[dict], next_: dict, delay_ms: int | None = None) -> dict:
        spec: dict = {"resourceRef": {"apiGroup": "v1", "kind": kind}, "selector": {"matchExpressions": match},
                      "next": next_}
        if delay_ms is not None:
            spec["delay"] = {"durationMilliseconds": delay_ms, "jitterDurationMilliseconds": delay_ms + 5000}
        return {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Stage", "metadata": {"name": name}, "spec": spec}

    ready_is = '.status.conditions.[] | select( .type == "Ready" ) | .status'
    never_ready = f'.metadata.labels["{NEVER_READY_LABEL[0]}"]'

    def running(ready: bool) -> str:
        return pod_running_status.replace("@READY@", str(ready)).replace("@ready@", str(ready).lower())
    return [
        stage("localcluster-node-initialize", "Node",
              [{"key": ready_is, "operator": "NotIn", "values": ["True"]}],
              {"statusTemplate": node_status}),
        # Node leases (kwok --node-lease-duration-seconds) are the main heartbeat; this refreshes the conditions
        # now and then so the node lifecycle controller never sees stale status.
        stage("localcluster-node-heartbeat", "Node",
              [{"key": ".status.phase", "operator": "In", "values": ["Running"]},
               {"key": ready_is, "operator": "In", "values": ["True"]}],
              {"statusTemplate": heartbeat_status}, delay_ms=20000),
        stage("localcluster-pod-running", "Pod",
              [{"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
               {"key": ".status.phase", "operator": "In", "values": ["Pending"]},
               {"key": never_ready, "operator": "DoesNotExist"}],
              {"statusTemplate": running(True)}),
        stage("localcluster-pod-running-never-ready", "Pod",
              [{"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
               {"key": ".status.phase", "operator": "In", "values": ["Pending"]},
               {"key": never_ready, "operator": "In", "values": [NEVER_READY_LABEL[1]]}],
              {"statusTemplate": running(False)}),
        stage("localcluster-pod-delete", "Pod",
              [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}],
              {"delete": True}),
    ]
