#!/usr/bin/env bash
# The main job: two real Kubernetes nodes in network namespaces, `helm install` of the chart with the operator image
# built here, examples' tcp pair running vLLM (engine image) with prefill and decode on different nodes, a completion
# through the pair's Service, a timeline, teardown (hack/demo_realnode.py).
# `bash hack/demo.sh --kwok`: the older demo on kwok's fake nodes (hack/demo.py; a stand-in decode listener).
source "$(dirname "$0")/lib.sh"
cd "$PDPAIR_ROOT"

ensure_build_tools
ensure_venv "operator,connector,engine,test"
ensure_tools
ensure_controlplane

if [ "${1:-}" = "--kwok" ]; then
  shift
  log "demo on kwok (fake nodes)"
  exec "$PY" "$PDPAIR_ROOT/hack/demo.py" "$@"
fi
ensure_realnode
log "demo on real nodes"
"$PY" "$PDPAIR_ROOT/hack/demo_realnode.py" "$@"
