#!/usr/bin/env bash
# The main job on the embedded default: a local control plane, the chart's CRD/RBAC, the operator under its
# ServiceAccount, and examples/inferencepair.yaml reaching Ready.
source "$(dirname "$0")/lib.sh"
cd "$PDPAIR_ROOT"

ensure_build_tools
ensure_venv "operator,connector,test"
ensure_tools
ensure_controlplane

log "demo"
"$PY" "$PDPAIR_ROOT/hack/demo.py" "$@"
