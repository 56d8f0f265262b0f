"""No JSON object repeats a key, no unique array repeats an item: a per-request tracker over
any backend's matcher.

The backends' JSON compilers emit each declared property at most once (declared properties come
in declared order; additional keys may not equal a declared name), but keys that come from
``additionalProperties``, ``patternProperties`` or an untyped object are free strings, and a
grammar cannot say "unlike every key before" (not context-free). So
:class:`~espalier.constrained.keys.matcher.UniqueKeysMatcher` wraps a request's matcher: a small
JSON lexer in C (``keys.c``, through ``native.py``) follows the accepted bytes (the stack of open
containers, each object's keys so far), and a token that would *complete* a key already present
in its object (the closing quote of the key string, wherever in the token it falls) is removed
from the backend's row and rejected by ``accept``. Nothing else changes: the row is the backend's
row minus exactly those tokens. The Python twin of the lexer and filters, the tests' oracle, is
``tests/fixtures/keys_twin.py``.

Unique items (``docs/decisions/unique-items.md``): the same lexer follows the schema's places
(:mod:`~espalier.constrained.schema.unique_places`: which arrays must hold unique items) and each
such array's items, compared as ``jsonschema`` compares them; a token that would complete an
item already in its array (a string's closing quote, the byte ending a number, a literal's last
letter, or one that ends inside a literal already there) is removed and refused the same way,
except that ``accept`` never lets a duplicate item through.

Exactness: a key can still be extended or changed, so removing its duplicate completions leaves a
way on, unless the grammar's key language is finite and exhausted (``propertyNames: {"enum":
[...]}``, an anchored ``patternProperties`` with ``minProperties``, a key at its ``maxLength``).
Unique string items whose length is bounded (``maxLength``, a ``date`` or ``uuid`` format, a pattern
of bounded strings: ``EspPlaces.item_chars``, at most 64 characters) are watched one token earlier:
a token that leaves an item at that length equal to an earlier item is refused as if it completed
it, since only the closing quote could follow. Unique string items from a short list (a pattern of
fewer than 4,096 strings, ``EspPlaces.words``) are watched at every character: a token after which
every listed word that extends the item is an earlier item is refused (``"b`` once ``ba``, ``bb``
and ``bc`` are taken under ``^[a-c]{2}$``; the opening quote once every word is; with an escape
pending, only the words whose next character it may write count, as the backends escape a listed
word: ``keys.c``'s ``escape_reaches``). Elsewhere every
allowed token may complete a duplicate; the tracker then removes nothing (a row is never emptied)
and ``accept`` refuses the duplicate all the same (as it refuses a duplicate item): no instance
with a repeated key is accepted. The closing policy's check before each token sees the dead end
one token early and closes the output there; past its window the request ends with an error
that says why (:meth:`UniqueKeysMatcher.refusal`). Unique string items from a short list also
get a ``maxItems`` of one item per word (``unique_places.cap_listed_items``): the grammar then
refuses the comma that would open an item no word is left for.
"""

from espalier.constrained.keys.matcher import UniqueKeysMatcher, may_repeat_keys, with_unique_keys

__all__ = ["UniqueKeysMatcher", "may_repeat_keys", "with_unique_keys"]
