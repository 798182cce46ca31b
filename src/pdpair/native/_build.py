"""cffi builder (API/out-of-line mode) for pdpair.native._pdpair_native.

setup.py names `src/pdpair/native/_build.py:ffibuilder`, so `pip install` compiles native/src/*.c into the
extension; nothing prebuilt is kept in git. The cdef is the block between the cffi markers of
native/include/pdpair/transport.h, so the header stays the one description of the API, and the compiler checks
that block against the real declarations.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

REPO_ROOT = Path(__file__).resolve().parents[3]
NATIVE = REPO_ROOT / "native"
HEADER = NATIVE / "include" / "pdpair" / "transport.h"
BEGIN, END = "/* cffi-begin */", "/* cffi-end */"


def _cdef_from_header(header: Path) -> str:
    text = header.read_text()
    try:
        start = text.index(BEGIN) + len(BEGIN)
        stop = text.index(END, start)
    except ValueError as exc:
        raise RuntimeError(f"{header}: the {BEGIN} ... {END} block is missing") from exc
    return text[start:stop]


def _relative(path: Path) -> str:
    # setuptools wants paths relative to setup.py when it builds from the repo root (pip install, sdist);
    # anything else (ffibuilder.compile(), which changes into its tmpdir) needs absolute paths.
    if Path.cwd().resolve() == REPO_ROOT:
        return os.path.relpath(path, REPO_ROOT)
    return str(path)


ffibuilder = FFI()
ffibuilder.cdef(_cdef_from_header(HEADER))
ffibuilder.set_source(
    "pdpair.native._pdpair_native",
    '#include "pdpair/transport.h"\n',
    sources=[_relative(p) for p in sorted((NATIVE / "src").glob("*.c"))],
    include_dirs=[_relative(NATIVE / "include"), _relative(NATIVE / "src")],
    depends=[_relative(p) for p in sorted(NATIVE.glob("*/**/*.h"))],
    extra_compile_args=["-std=c11", "-O2", "-pthread", "-Wall"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
