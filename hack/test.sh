#!/usr/bin/env bash
# The test command: installs everything a fresh machine needs, then runs every test.
# Extra arguments go to pytest (e.g. `bash hack/test.sh -k operator`).
source "$(dirname "$0")/lib.sh"
cd "$PDPAIR_ROOT"

ensure_build_tools
ensure_prometheus
ensure_venv "operator,connector,engine,test"
ensure_tools
ensure_controlplane
ensure_realnode

log "native C tests under ASan, UBSan and TSan"
make -C native check

log "pytest"
"$PY" -m pytest -ra --durations=40 "$@"  # the 40 slowest tests: where the CI time goes
