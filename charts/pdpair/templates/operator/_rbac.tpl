{{/*
The operator's RBAC rules, in two sets, so the cluster-wide and the namespaced modes grant the same rights from one
list (README.md "RBAC" explains each rule):
- pdpair.operator.pairRules: everything namespaced the operator touches where pairs live. Without
  operator.watchNamespaces they go into the ClusterRole (pairs may live anywhere); with it, into a Role in each
  watched namespace (watched-roles.yaml; role.yaml for the release namespace), and the ClusterRole keeps only
- pdpair.operator.clusterReadRules: the cluster-scoped reads (nodes, namespaces, CRDs).
The port Leases and the leader-election Lease live in the release namespace only (role.yaml), in both modes.
*/}}
{{- define "pdpair.operator.pairRules" -}}
# Watch pairs; patch adds kopf's finalizer and annotations (metadata lives on the main resource).
- apiGroups: [pdpair.io]
  resources: [inferencepairs]
  verbs: [get, list, watch, patch, update]
# get reveals nothing that get on inferencepairs does not; kubectl patch --subresource=status needs it.
- apiGroups: [pdpair.io]
  resources: [inferencepairs/status]
  verbs: [get, patch, update]
# Pods are created with an ownerReference blockOwnerDeletion=true (kopf.adopt); clusters running the
# OwnerReferencesPermissionEnforcement admission plugin require update on the owner's finalizers for that.
- apiGroups: [pdpair.io]
  resources: [inferencepairs/finalizers]
  verbs: [update]
# The pairs' scale objects, one InferencePairRole <pair>-<role> per role (owned by the pair, with the /scale
# subresource): watched to wake the pair when kubectl scale or an autoscaler moves spec.replicas, made when missing.
# The operator never deletes one (the garbage collector removes them with the pair).
- apiGroups: [pdpair.io]
  resources: [inferencepairroles]
  verbs: [get, list, watch, create, patch]
# Their status: desired, replicas (ready instances) and selector, what /scale reports to an autoscaler.
- apiGroups: [pdpair.io]
  resources: [inferencepairroles/status]
  verbs: [get, patch, update]
# The pair's decode, prefill and router pods; patch only marks an instance a scale-down drains (annotation
# pdpair.io/draining-since).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete, patch]
# The pair's Secret `<pair>-peers` (owned by the pair): the bearer token its prefill and router pods take for the
# operator's pushes of their peer sets (xPyD). Create only: the token is derived from the operator's key and the
# pair's uid (PDPAIR_PEERS_KEY), so the operator never reads a Secret.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# The router Service `<pair>` (ClusterIP, owned by the pair): watched to recreate it, patched when the router
# port changes, deleted when spec.router.enabled turns false.
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, delete, patch]
# The pair's PodDisruptionBudget `<pair>` (an integer minAvailable above its pod count, owned by the pair):
# watched to make a missing one; patched only to bring one an older operator made back to that spec; never
# deleted by the operator (the garbage collector removes it with the pair).
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
# kopf posts an Event per step; old and new Events APIs.
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- if .Values.operator.networkPolicy.enabled }}
# The pair's NetworkPolicy `<pair>` (operator.networkPolicy.enabled; owned by the pair): made when missing, read to
# tell one of another owner of that name (left alone) and patched back to the operator's spec; never deleted by the
# operator (the garbage collector removes it with the pair). Not watched: re-read every few resyncs.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
{{- end }}
{{- end }}

{{- define "pdpair.operator.clusterReadRules" -}}
# Nodes, read only: a pair pod's node that is unreachable or NotReady too long counts as lost, and the pair is
# re-homed with that pod's ports fenced (docs/design.md, "Lost nodes"); a cordoned node's pairs move off it
# before a drain's evictions (docs/design.md, "Drained nodes").
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list, watch]
# kopf lists and watches namespaces, cluster-wide or to follow watchNamespaces (without it kopf takes the names
# as given and logs a warning).
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
# kopf scans the CRDs at start to resolve InferencePair's group/version, and watches them.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
