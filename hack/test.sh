#!/usr/bin/env bash
# The test command: installs everything a fresh machine needs, then runs every test.
# Extra arguments go to pytest (e.g. `bash hack/test.sh -k operator`).
# Prints the caches' sizes at the start and a table of wall time per phase (each build, each test tier) at the end;
# stops with a message naming the tier when the whole command passes PDPAIR_CI_BUDGET_SECONDS (tests/ci_budget.py).
export PDPAIR_CI_STARTED=${PDPAIR_CI_STARTED:-$(date +%s)}
source "$(dirname "$0")/lib.sh"
cd "$PDPAIR_ROOT"

export PDPAIR_CI_PHASES=${PDPAIR_CI_PHASES:-$(mktemp -t pdpair-phases.XXXXXX)}
: > "$PDPAIR_CI_PHASES"
report_phases() {
  local rc=$?
  log "wall time per phase (rc $rc)"
  python3 "$PDPAIR_ROOT/tests/ci_budget.py" report "$PDPAIR_CI_PHASES" >&2 || true
  exit $rc
}
trap report_phases EXIT

print_cache_sizes
phase "Debian build tools" ensure_build_tools
phase "Debian prometheus" ensure_prometheus
phase "venv + pdpair" ensure_venv "operator,connector,engine,test"
phase "kubectl, helm" ensure_tools
phase "control plane (Go)" ensure_controlplane
phase "real node: Debian packages" ensure_realnode_packages

# Only the real-node tier (which runs last: TIER_ORDER in tests/conftest.py) needs the node binaries and the images:
# build them in the background while the other tiers run. The tier's fixtures take the same build locks
# (tests/cluster/images.py, realnode.py), so they wait for what is still being built and never build it twice.
realnode_log=$(mktemp -t pdpair-realnode-build.XXXXXX)
log "real-node binaries and images: building in the background (log: $realnode_log)"
(
  set -e
  phase "real node: kubelet, kube-proxy, containerd (Go; background)" ensure_realnode_binaries
  phase "image: Debian base (background)" ensure_image base
  phase "image: operator (background)" ensure_image operator
  phase "image: engine base, vLLM and torch (background)" ensure_image engine-base
  phase "image: engine, pdpair layer (background)" ensure_image engine
) >"$realnode_log" 2>&1 &
realnode_build=$!

log "native C tests under ASan, UBSan and TSan"
phase "native C tests" make -C native check

log "pytest"
rc=0
"$PY" -m pytest -ra --durations=40 "$@" || rc=$?  # the 40 slowest tests: where the CI time goes
if ! wait "$realnode_build"; then
  # The real-node fixtures build what the background did not (same code, same locks); if they did, this is quick.
  log "the background build of the real-node binaries and images failed (its log below); building them again"
  tail -n 60 "$realnode_log" >&2
  (set -e; ensure_realnode_binaries; for image in base operator engine-base engine; do ensure_image "$image"; done) \
    || { [ "$rc" != 0 ] || rc=1; }
fi
exit "$rc"
