"""The optional C fast path (ringwire/_wire/_cring.c), built where a compiler exists.

Everything else about the package is in pyproject.toml.  The extension is declared
here because a build that cannot compile it must still succeed: ``OptionalBuildExt``
prints one line and installs the pure-Python path (``ringwire.native`` is then
``False``).  It is a plain setuptools ``Extension`` (no Cython) so that building needs
nothing beyond setuptools and a C compiler, and the C11 atomics the ordering argument
rests on are written as such.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: no compiler (or a failed compile) means
    the pure-Python path."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all: distutils' CCompilerError, OSError...
            self._fallback(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._fallback(exc)

    @staticmethod
    def _fallback(exc: BaseException) -> None:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(
            f"ringwire: the C fast path was not built ({msg}); the pure-Python path is used",
            file=sys.stderr,
        )


setup(
    ext_modules=[
        Extension(
            "ringwire._wire._cring",
            sources=["ringwire/_wire/_cring.c"],
            extra_compile_args=_FLAGS,
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
