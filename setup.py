"""setuptools glue that pyproject.toml cannot express.

- Two source roots, operator/ and connector/, both hold packages under the `pdpair` namespace
  (there is deliberately no pdpair/__init__.py and nothing importable as a bare `operator`).
- cffi builds the native transport binding from native/ at install time.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

HERE = Path(__file__).parent
SOURCE_ROOTS = ("operator", "connector")

package_dir: dict[str, str] = {}
for root in SOURCE_ROOTS:
    for package in find_namespace_packages(root, include=["pdpair.*"]):
        folder = Path(root, *package.split("."))
        if (folder / "__init__.py").exists():
            package_dir[package] = str(folder)

setup(
    packages=sorted(package_dir),
    package_dir=package_dir,
    cffi_modules=["connector/pdpair/native/_build.py:ffibuilder"],
)
