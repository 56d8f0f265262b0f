"""Formats whose post-validation checker is itself a regular expression, as that expression.

``jsonschema`` checks ``uri-reference`` with ``rfc3986_validator`` (``jsonschema._format``:
when the GPL ``rfc3987`` package is absent; ``jsonschema[format-nongpl]`` installs the former
only), whose check is ``re.compile("^(?:URI|relative-ref)$", re.VERBOSE).match``. The same
expression without its verbose-mode spacing and comments, as a ``pattern`` (``regex.search``
reads ``^`` / ``$`` as ``re.match`` does here), is then exactly the checker's language; ``{,n}``
is spelled ``{0,n}`` (Rust's regex, llguidance's and outlines-core's, needs the lower bound).
None when ``jsonschema`` would check the format otherwise (``rfc3987`` installed) or not at all.
``iri`` / ``iri-reference`` are checked by a Lark grammar (``rfc3987_syntax``): not here.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def checker_pattern(name: str) -> str | None:
    """The ``pattern`` equal to the format checker of ``name``; None when there is none."""
    if name != "uri-reference" or importlib.util.find_spec("rfc3987") is not None:
        return None
    try:
        import rfc3986_validator
    except ImportError:
        return None
    return _plain(rfc3986_validator.URI_REF_RE_COMP.pattern).replace("{,", "{0,")


def _plain(verbose: str) -> str:
    """``verbose`` (``re.VERBOSE`` syntax) without its unescaped spacing and ``#`` comments
    outside classes."""
    out: list[str] = []
    at, in_class = 0, False
    while at < len(verbose):
        char = verbose[at]
        if char == "\\":
            out.append(verbose[at : at + 2])
            at += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "#":
            at = verbose.find("\n", at) % (len(verbose) + 1)
            continue
        elif char.isspace():
            at += 1
            continue
        out.append(char)
        at += 1
    return "".join(out)
