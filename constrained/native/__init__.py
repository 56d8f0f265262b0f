"""Small C helpers for the grammar layer, compiled at first use (``build.py``).

``llg_walk.c``: the draft-tree walk over llguidance's C API (``llguidance.py`` binds it). Each
helper is optional: without a C compiler the pure-Python walks are used.
"""
