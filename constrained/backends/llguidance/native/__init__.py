"""llguidance's C API and the native draft-tree walk over it.

``llg_walk.c`` (the walk) and ``llg_abi.c``/``llg_abi.h`` (llguidance's C structs, for the series
pyproject.toml pins) are built into the extension ``_llg_walk`` when the package is installed
(``setup.py``); ``llguidance.py`` loads it through ctypes and checks llguidance's version and
layout first. Nothing is compiled at run time.
"""
