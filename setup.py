"""setuptools glue that pyproject.toml cannot express: cffi builds the native transport binding (pdpair.native) from
native/ at install time. The packages themselves come from src/ (pyproject.toml, [tool.setuptools.packages.find])."""

from setuptools import setup

setup(cffi_modules=["src/pdpair/native/_build.py:ffibuilder"])
