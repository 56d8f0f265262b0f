"""The native part of espalier, built with the package (``pip install``/``pip install -e``).

Everything else is declared in pyproject.toml. The llguidance tree walk
(``constrained/backends/llguidance/native/``) and the duplicate-key tracker
(``constrained/keys/keys.c``) are C loaded through ctypes: they link against nothing but libc and
pthreads (llguidance's functions come in as pointers at run time), so each is built as an
extension module of no Python API, with the system C compiler, once, here.
"""

from setuptools import Extension, setup

NATIVE = "constrained/backends/llguidance/native"

setup(
    ext_modules=[
        Extension(
            "espalier.constrained.backends.llguidance.native._llg_walk",
            sources=[f"{NATIVE}/llg_walk.c", f"{NATIVE}/llg_abi.c", f"{NATIVE}/llg_close.c"],
            depends=[f"{NATIVE}/llg_abi.h"],
            include_dirs=[NATIVE],
            extra_compile_args=["-O2", "-pthread", "-std=c11", "-D_POSIX_C_SOURCE=200809L"],
            extra_link_args=["-pthread"],
        ),
        Extension(
            "espalier.constrained.keys._keys",
            sources=["constrained/keys/keys.c"],
            extra_compile_args=["-O2", "-pthread", "-std=c11", "-D_POSIX_C_SOURCE=200809L"],
            extra_link_args=["-pthread"],
            libraries=["m"],
        ),
    ]
)
