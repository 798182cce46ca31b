#!/bin/bash
# libflagcx for the CUDA engine image (images/engine-cuda/Dockerfile), built against the NCCL and CUDA runtime that
# torch's wheels put into the venv, so that libflagcx and vLLM share one libnccl and one libcudart.
#
#   flagcx.sh build SRC PREFIX PYTHON   compile the FlagCX tree SRC into PREFIX (PREFIX/lib/libflagcx.so)
#   flagcx.sh check PREFIX PYTHON       print how the library links, then load it through pdpair's connector
#
# build: SRC is an upstream FlagCX tree (git archive of one commit; never committed to this repository). PYTHON is
# the venv's python, whose site-packages hold the nvidia-nccl-cu13 and nvidia-cuda-runtime wheels. It makes
#   PREFIX/nccl/{include,lib}   FlagCX's CCL_HOME: links into the nvidia-nccl wheel (include/nccl.h, lib/libnccl.so.2,
#                               and lib/libnccl.so, which the Makefile's -lnccl and FlagCX's own dlopen("libnccl.so")
#                               need). Kept at run time: the library's RUNPATH names PREFIX/nccl/lib.
#   a temporary DEVICE_HOME     include/ (cuda_runtime.h, cuda.h from the nvidia-cuda-runtime wheel, overlaid with
#                               CUDA_EXTRA_INCLUDE: crt/host_config.h, which cuda_runtime.h includes, from
#                               nvidia-cuda-crt, and CCCL's cccl/cuda/atomic from nvidia-cuda-cccl; torch's wheels
#                               bring neither) and lib64/ (libcudart.so -> the wheel's libcudart.so.13; libcuda.so,
#                               an empty link-time stand-in for the driver, soname libcuda.so.1). FlagCX's Makefile wants $(DEVICE_HOME)/include, .../include/cccl,
#                               .../lib64 and links -lcudart -lcuda. Gone after the build: the driver's libcuda.so.1
#                               comes from the node (the NVIDIA container runtime mounts it).
# and runs FlagCX's make with USE_NVIDIA=1, BUILDDIR=PREFIX (so the library's RUNPATH names PREFIX/lib, not a build
# directory), the linker adding the CUDA runtime's directory to the RUNPATH (HOST_LINKER), and FLAGCX_MAKE_ARGS.
# PREFIX/BUILD-INFO records the commit, the versions and FlagCX's `make print_var` (its adaptor flags).
# Environment: CUDA_EXTRA_INCLUDE (required: an include directory holding crt/host_config.h and cccl/cuda/atomic,
# e.g. DIR/nvidia/cu13/include after `pip install --target DIR "cuda-toolkit[crt,cccl]==<torch's version>"`),
# JSON_INCLUDE_DIR (default /usr/include: the directory holding nlohmann/json.hpp, since a git archive lacks FlagCX's
# json submodule), FLAGCX_MAKE_ARGS (extra VAR=value words for make), JOBS (default nproc).
#
# check: no GPU needed. Without a driver (an image build) libcuda.so.1 is missing, and libflagcx calls cuMem* and
# friends directly, so a stand-in defining each cu* symbol libflagcx imports (each returns CUDA_ERROR_UNKNOWN; none
# is called) is compiled into a temporary directory for the load only. Loading then runs what the connector's worker
# runs: PdPairConfig from a pod's variables (PDPAIR_TRANSPORT=flagcx, the image's FLAGCX_PATH), build_transport,
# which loads the library through pdpair's loader, calls flagcxGetVersion and the generation probe
# (flagcxWaitSignal(NULL, 0, 0, 0, NULL): it dereferences nothing in either API generation). Fails unless the
# generation is EXPECTED_GENERATION (environment; unset: any). On a GPU node the driver's libcuda.so.1 is used.
set -euo pipefail

die() { echo "flagcx.sh: error: $*" >&2; exit 1; }

site_packages() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

one() {  # the single existing path matching a glob, else an error naming what is missing
    local what=$1; shift
    local found=()
    for p in "$@"; do [ -e "$p" ] && found+=("$p"); done
    [ "${#found[@]}" -eq 1 ] || die "expected exactly one $what, found ${#found[@]}: ${found[*]:-none} (pattern $*)"
    echo "${found[0]}"
}

build() {
    local src=$1 prefix=$2 python=$3
    [ -f "$src/Makefile" ] || die "no FlagCX tree at $src (no Makefile)"
    local extra=${CUDA_EXTRA_INCLUDE:-}
    [ -n "$extra" ] && [ -f "$extra/crt/host_config.h" ] && [ -f "$extra/cccl/cuda/atomic" ] \
        || die "CUDA_EXTRA_INCLUDE=$extra holds no crt/host_config.h and cccl/cuda/atomic"
    local json=${JSON_INCLUDE_DIR:-/usr/include}
    [ -f "$json/nlohmann/json.hpp" ] || die "no nlohmann/json.hpp under JSON_INCLUDE_DIR=$json"
    local sp; sp=$(site_packages "$python")
    local nccl_h nccl_root nccl_so cudart_so cuda_root
    nccl_h=$(one "nccl.h of the nvidia-nccl wheel" "$sp"/nvidia/*/include/nccl.h)
    nccl_root=$(dirname "$(dirname "$nccl_h")")
    nccl_so=$(one "libnccl.so.N in the nvidia-nccl wheel" "$nccl_root"/lib/libnccl.so.[0-9])
    cudart_so=$(one "libcudart.so.N of the nvidia-cuda-runtime wheel" "$sp"/nvidia/*/lib/libcudart.so.[0-9]*)
    cuda_root=$(dirname "$(dirname "$cudart_so")")
    [ -f "$cuda_root/include/cuda_runtime.h" ] || die "no cuda_runtime.h beside $cudart_so"

    mkdir -p "$prefix/nccl/lib"
    ln -sfn "$nccl_root/include" "$prefix/nccl/include"
    ln -sfn "$nccl_so" "$prefix/nccl/lib/$(basename "$nccl_so")"
    ln -sfn "$(basename "$nccl_so")" "$prefix/nccl/lib/libnccl.so"

    local work; work=$(mktemp -d)
    trap "rm -rf '$work'" EXIT  # also after a failed make
    mkdir -p "$work/cuda/include" "$work/cuda/lib64"
    cp -a "$cuda_root/include/." "$work/cuda/include/"
    cp -a "$extra/." "$work/cuda/include/"
    ln -s "$cudart_so" "$work/cuda/lib64/libcudart.so"
    echo 'void pdpair_link_time_stub_of_libcuda(void) {}' > "$work/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$work/cuda/lib64/libcuda.so" "$work/stub.c"

    local args=(USE_NVIDIA=1 "BUILDDIR=$prefix" "DEVICE_HOME=$work/cuda" "CCL_HOME=$prefix/nccl"
                "HOST_LINKER=g++ -Wl,-rpath,$(dirname "$cudart_so")")
    # shellcheck disable=SC2206 # FLAGCX_MAKE_ARGS is a list of VAR=value words
    args+=(${FLAGCX_MAKE_ARGS:-})
    # JSON_INCLUDE_DIR is a Makefile variable only in later trees (0c721293); 6493e5f8 looks in third-party/json
    # (empty in a git archive) and the compiler's default path, which CPLUS_INCLUDE_PATH extends. A directory that
    # is already on the compiler's default path (Debian's nlohmann-json3-dev: /usr/include) is named nowhere: as -I
    # or in CPLUS_INCLUDE_PATH it moves ahead of libstdc++'s headers and their `#include_next <stdlib.h>` fails
    # ("stdlib.h: No such file or directory", seen in the first image build).
    case "$json" in
        /usr/include | /usr/local/include) ;;
        *) args+=("JSON_INCLUDE_DIR=$json")
           export CPLUS_INCLUDE_PATH=$json${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH} ;;
    esac
    echo "flagcx.sh: make -C $src -j${JOBS:-$(nproc)} ${args[*]}"
    local started=$SECONDS
    make -C "$src" -j"${JOBS:-$(nproc)}" "${args[@]}"
    [ -f "$prefix/lib/libflagcx.so" ] || die "make finished without $prefix/lib/libflagcx.so"
    {
        echo "commit: $(cat "$src/.pdpair-flagcx-commit" 2>/dev/null || echo unknown)"
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - started)) s"
        echo "make args: ${args[*]}" | sed "s#$work#<temporary DEVICE_HOME>#g"
        echo "nccl: $(basename "$nccl_so") from $nccl_root, NCCL $(awk '/#define NCCL_(MAJOR|MINOR|PATCH) /{printf "%s%s", sep, $3; sep="."}' "$nccl_h")"
        echo "cudart: $cudart_so"
        echo "--- make print_var"
        make -s -C "$src" "${args[@]}" print_var 2>/dev/null | sed "s#$work#<temporary DEVICE_HOME>#g"
    } > "$prefix/BUILD-INFO"
    rm -rf "$prefix/obj" "$work"
    cat "$prefix/BUILD-INFO"
}

check() {
    local prefix=$1 python=$2
    local lib=$prefix/lib/libflagcx.so
    [ -f "$lib" ] || die "no $lib"
    echo "--- $prefix/BUILD-INFO"; cat "$prefix/BUILD-INFO" 2>/dev/null || echo "(none)"
    echo "--- readelf -d $lib (NEEDED, RUNPATH)"; readelf -d "$lib" | grep -E 'NEEDED|RUNPATH|RPATH'
    echo "--- ldd $lib"; ldd "$lib"
    local missing; missing=$(ldd "$lib" | awk '/not found/ && $1 != "libcuda.so.1" {print $1}')
    [ -z "$missing" ] || die "$lib: libraries not found at load: $missing (only the driver's libcuda.so.1 may be)"

    local stub="" libpath=${LD_LIBRARY_PATH:-}
    if ! "$python" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>/dev/null; then
        stub=$(mktemp -d)
        trap "rm -rf '$stub'" EXIT  # expanded now: $stub is local to this function
        libpath=$stub${libpath:+:$libpath}
        nm -D --undefined-only "$lib" | awk '{sub(/@.*/, "", $2); if ($2 ~ /^cu[A-Z]/) print "int " $2 "(void) { return 999; }"}' \
            > "$stub/libcuda.c"
        echo "--- no driver here: libcuda.so.1 stand-in for the load only, $(wc -l < "$stub/libcuda.c") symbols"
        gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so.1" "$stub/libcuda.c"
    fi
    echo "--- load through the connector (PdPairConfig -> build_transport)"
    LD_LIBRARY_PATH=$libpath "$python" - <<'EOF'
import os

from pdpair import contract
from pdpair.connector.config import PdPairConfig
from pdpair.connector.transports import build_transport

env = {**os.environ, contract.ENV_TRANSPORT: contract.TRANSPORT_FLAGCX, contract.ENV_LISTEN_PORT_BASE: "20000"}
transport = build_transport(PdPairConfig.from_env("kv_consumer", environ=env))
lib = transport.lib
print(f"libflagcx {lib.path}: flagcxGetVersion {lib.version}, API generation {lib.generation}, "
      f"caller-allocated uid {lib.caller_allocated_uid}, FLAGCX_USE_HETERO_COMM={os.environ.get('FLAGCX_USE_HETERO_COMM')}")
expected = os.environ.get("EXPECTED_GENERATION")
if expected and lib.generation != expected:
    raise SystemExit(f"libflagcx has the {lib.generation} API generation, expected {expected}")
transport.close()
EOF
}

case "${1:-}" in
    build) shift; [ $# -eq 3 ] || die "usage: flagcx.sh build SRC PREFIX PYTHON"; build "$@" ;;
    check) shift; [ $# -eq 2 ] || die "usage: flagcx.sh check PREFIX PYTHON"; check "$@" ;;
    *) die "usage: flagcx.sh build SRC PREFIX PYTHON | check PREFIX PYTHON" ;;
esac
