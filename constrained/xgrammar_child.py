"""The child process that compiles xgrammar grammars, killable at the compile's deadline.

Run as ``python -m espalier.constrained.xgrammar_child`` by the xgrammar backend's
:class:`~espalier.constrained.compile_pool.ChildPool`; the protocol is
``constrained/compile_child.py``'s:

- setup payload: one line of JSON ``{"max_threads": n}``, then
  ``xgrammar.TokenizerInfo.serialize_json()`` (about a second to build for 262,144 tokens, so the
  parent builds it once per tokenizer): the child builds its ``GrammarCompiler`` once;
- request: JSON ``{"method": <a GrammarCompiler compile method>, "kwargs": {...}}``;
- answer: ``xgrammar.CompiledGrammar.serialize_json()`` (UTF-8), which the parent deserializes
  against its own ``TokenizerInfo``.

xgrammar offers no way to cancel a compile (mlc-ai/xgrammar#298), and a JSON schema compile on
a 262,144-token vocabulary can take minutes; here the parent kills the child at the deadline.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from espalier.constrained.compile_child import Handler, serve

METHODS = frozenset(
    {
        "compile_json_schema",
        "compile_regex",
        "compile_grammar",
        "compile_lark",
        "compile_structural_tag",
    }
)


def setup(payload: bytes) -> Handler:
    import xgrammar

    head, _, serialized = payload.partition(b"\n")
    config = json.loads(head)
    info = xgrammar.TokenizerInfo.deserialize_json(serialized.decode("utf-8"))
    compiler = xgrammar.GrammarCompiler(
        info, max_threads=config["max_threads"], cache_enabled=False
    )

    def build(request: bytes) -> bytes:
        asked = json.loads(request)
        method = asked["method"]
        if method not in METHODS:
            raise ValueError(f"unknown compile method {method!r}")
        kwargs: dict[str, Any] = asked["kwargs"]
        if isinstance(kwargs.get("separators"), list):
            kwargs["separators"] = tuple(kwargs["separators"])
        compiled = getattr(compiler, method)(**kwargs)
        text: str = compiled.serialize_json()
        return text.encode("utf-8")

    return build


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer, setup)
