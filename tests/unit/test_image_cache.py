"""The image cache keeps a bounded number of archives per image name (devcluster/images.py)."""

import os

from devcluster import images


def test_prune_keeps_the_newest_archives_of_that_name_only(tmp_path, monkeypatch):
    monkeypatch.setattr(images, "images_dir", lambda: tmp_path)
    engine = [tmp_path / f"pdpair-engine-{i:016x}.oci.tar" for i in range(5)]
    operator = [tmp_path / f"pdpair-{i:016x}.oci.tar" for i in range(2)]
    other = [tmp_path / "debian-python-0123456789abcdef.oci.tar", tmp_path / "pdpair-engine-0000000000000009.oci.tar.tmp",
             tmp_path / "pdpair-engine-base-0123456789abcdef.oci.tar"]  # the engine's base is an image of its own
    for age, path in enumerate(reversed(engine + operator + other)):
        path.write_bytes(b"x")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))  # within each name, later in the list is newer
    deleted = images.prune_archives("pdpair-engine", keep=3)
    assert sorted(deleted) == sorted(engine[:2])
    assert all(p.exists() for p in engine[2:] + operator + other)
    assert not any(p.exists() for p in engine[:2])
    assert images.prune_archives("pdpair", keep=1) == [operator[0]]  # "pdpair" never matches pdpair-engine-*
    assert all(p.exists() for p in engine[2:])


def test_an_images_key_follows_the_sources_not_the_build_leftovers(tmp_path, monkeypatch):
    """pip's egg-info (its PKG-INFO embeds the README), bytecode and native objects in src/ are not sources: a README
    edit re-keyed both images before, ~4 min of rebuilds in a warm CI run. A source edit still re-keys them."""
    import hashlib

    monkeypatch.setattr(images, "REPO_ROOT", tmp_path)
    src = tmp_path / "src"
    (src / "pdpair").mkdir(parents=True)
    (src / "pdpair" / "mod.py").write_text("x = 1\n")

    def key():
        h = hashlib.sha256()
        images._hash_tree([src], h)
        return h.hexdigest()

    before = key()
    (src / "pdpair.egg-info").mkdir()
    (src / "pdpair.egg-info" / "PKG-INFO").write_text("Description: the README, as it is today\n")
    (src / "pdpair" / "__pycache__").mkdir()
    (src / "pdpair" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (src / "pdpair" / "_native.abi3.so").write_bytes(b"\0")
    assert key() == before
    (src / "pdpair" / "mod.py").write_text("x = 2\n")
    assert key() != before
