"""OCI image layout archives (uncompressed layers) that `ctr images import` and buildah take; used for the pause
image, the Debian base image and the in-cluster Prometheus image."""
from __future__ import annotations

import hashlib
import io
import json
import pathlib
import tarfile
import tempfile


def write_oci_archive(dest: pathlib.Path, ref: str, layers: list[bytes], config: dict) -> str:
    """Writes an OCI image layout tar (uncompressed layers) that `ctr images import` takes; returns the manifest
    digest. `ref` goes into the index's ref-name annotation, which is the image name after import."""
    with tempfile.TemporaryDirectory(prefix="pdpair-oci-") as tmp:
        paths = []
        for i, data in enumerate(layers):
            paths.append(pathlib.Path(tmp) / f"layer{i}.tar")
            paths[-1].write_bytes(data)
        return write_oci_archive_from_files(dest, ref, paths, config)


def write_oci_archive_from_files(dest: pathlib.Path, ref: str, layers: list[pathlib.Path], config: dict) -> str:
    """write_oci_archive for layer tar files (streamed, never read whole into memory)."""
    blobs: dict[str, bytes | pathlib.Path] = {}

    def blob(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    def file_blob(path: pathlib.Path) -> dict:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        digest = "sha256:" + h.hexdigest()
        blobs[digest] = path
        return {"digest": digest, "size": path.stat().st_size}

    layer_descs = [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **file_blob(p)} for p in layers]
    image_config = {
        "architecture": "amd64", "os": "linux", "config": config,
        "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in layer_descs]},
        # One history entry per layer, as every builder writes: buildah checks that an image built FROM this one
        # has as many non-empty history entries as layers, and refuses a second-generation child otherwise
        # ("history lists 2 non-empty layers, but we have 3 layers on disk": engine on engine-base on this base).
        "history": [{"created_by": f"pdpair: {p.name}"} for p in layers],
    }
    config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json",
                   **blob(json.dumps(image_config, sort_keys=True).encode())}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": layer_descs}
    manifest_desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                     **blob(json.dumps(manifest, sort_keys=True).encode()),
                     "annotations": {"org.opencontainers.image.ref.name": ref, "io.containerd.image.name": ref}}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest_desc]}

    def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(dest, "w") as tar:
        add(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add(tar, "index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            name = f"blobs/sha256/{digest.split(':', 1)[1]}"
            if isinstance(data, pathlib.Path):
                info = tarfile.TarInfo(name)
                info.size = data.stat().st_size
                info.mode = 0o644
                with open(data, "rb") as fh:
                    tar.addfile(info, fh)
            else:
                add(tar, name, data)
    return manifest_desc["digest"]
