"""Partial JSON values from a growing output: what a streamed JSON generation holds so far.

Parsed with pydantic-core's partial JSON parser (``from_json(..., allow_partial=...)``), so the
``pydantic`` extra is needed: ``pip install espalier-client[pydantic]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from espalier_client.types import Chunk

_NOTHING = object()


class PartialJson:
    """Feed text deltas; :meth:`feed` returns the value parsed so far when it changed.

    Incomplete strings are included as far as they go ("trailing-strings"); with a pydantic
    ``model`` a partial object is ``model.model_construct(**fields)`` (not validated: required
    fields may be missing), and :meth:`final` validates the whole text.
    """

    def __init__(self, schema: Any = True, model: Any = None) -> None:
        try:
            from pydantic_core import from_json
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError(
                "partial JSON streaming needs pydantic: pip install espalier-client[pydantic]"
            ) from exc
        self._from_json = from_json
        self.schema = schema
        self.model = model
        self.text = ""
        self._last: Any = _NOTHING

    def feed(self, delta: str) -> Any:
        """The value after ``delta``, or ``_NOTHING`` when it did not change (or is empty)."""
        self.text += delta
        if not self.text.strip():
            return _NOTHING
        try:
            value = self._from_json(self.text, allow_partial="trailing-strings")
        except ValueError:  # not even a prefix of JSON (cannot happen under a JSON constraint)
            return _NOTHING
        if value == self._last:
            return _NOTHING
        self._last = value
        if self.model is not None and isinstance(value, dict):
            return self.model.model_construct(**value)
        return value

    def final(self) -> Any:
        """The whole output, validated (a model instance when a model was given)."""
        from espalier_client.request import parse_json_output

        return parse_json_output(self.text, self.schema, self.model)


def partial_values(chunks: Iterable[Chunk], schema: Any = True, model: Any = None) -> Iterator[Any]:
    """Each new partial value as ``chunks`` arrive; the last one yielded is the final value,
    validated against ``schema`` / ``model``, when the output completed."""
    parser = PartialJson(schema, model)
    for chunk in chunks:
        value = parser.feed(chunk.text)
        if chunk.finished and chunk.finish_reason in ("stop", "grammar"):
            yield parser.final()
            return
        if value is not _NOTHING:
            yield value


async def apartial_values(
    chunks: AsyncIterator[Chunk], schema: Any = True, model: Any = None
) -> AsyncIterator[Any]:
    """:func:`partial_values` for an async stream."""
    parser = PartialJson(schema, model)
    async for chunk in chunks:
        value = parser.feed(chunk.text)
        if chunk.finished and chunk.finish_reason in ("stop", "grammar"):
            yield parser.final()
            return
        if value is not _NOTHING:
            yield value
