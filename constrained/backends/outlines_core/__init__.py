"""The outlines-core backend: regular languages as a token-level DFA (outlines-core's ``Index``).

- ``adapter.py``: the adapter (``Backend``, its compiled grammars and matchers);
- ``tree_walk.py``: the matcher's draft-tree walk (``fill_tree``);
- ``index.py``: ``IndexBuilder``, which builds each ``Index`` in a capped, killable child
  process; ``index_child.py``: that child.

``Backend`` is imported from ``adapter.py`` on first use, so that the child, which imports this
package on its way to ``index_child``, loads neither torch nor the adapter (each child would
hold them in its capped address space). The library itself is imported here: where it is
missing, importing this package fails, and the registry names the pip package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import outlines_core  # noqa: F401  (the library: fails the import where it is missing)

if TYPE_CHECKING:
    from espalier.constrained.backends.outlines_core.adapter import Backend


def __getattr__(name: str) -> Any:
    """``Backend``, from ``adapter.py`` on first use."""
    if name == "Backend":
        from espalier.constrained.backends.outlines_core.adapter import Backend

        return Backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Backend"]
