"""A regex constraint means what Python's ``regex`` module reads (a full match: the
post-validator's reading); a backend that would read a construct of it otherwise does not take it.

llguidance and outlines-core compile regexes in Rust's syntax, xgrammar in its own. Found by a
held-out sweep (354 regexes against ``regex.fullmatch``; each confirmed twice), every one a text
the backend accepted and the regex does not match:

- Rust (:func:`rust_misreading`): ``[`` and ``&&`` / ``--`` / ``~~`` inside a class (nested
  classes, set operations, ASCII POSIX classes: ``[^[:alpha:]]`` took ``é``); possessive
  quantifiers (``a*+a`` took ``a``: in Python it matches nothing); whitespace inside a count
  (``a{1, 3}``: a literal in Python); the flags ``R`` and ``U`` (``(?R)a`` took ``a``: CRLF mode
  in Rust, recursion in Python);
- xgrammar (:func:`xgrammar_misreading`): its ``\\s \\S \\D \\W`` and ``\\d \\w`` inside a negated
  class are not Python's Unicode classes (``\\D`` took ``٣``, ``\\s`` took U+FEFF); a class
  starting ``[\\^`` or ``[]`` / ``[^]``, and ``[`` inside a class; anchors inside the pattern
  (``a^b`` took ``ab``); octal escapes (``\\012`` took ``\\x0012``), inside classes too
  (``[\\012]{3}`` took ``221``), and ``\\p{..}`` inside a class (``[\\p{Greek}]`` took ``G``: read
  as letters). Its ``.`` also takes ``\\n``: :func:`dot_without_newline` respells it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

from espalier.constrained import gbnf
from espalier.constrained.schema.features import class_set_syntax
from espalier.constrained.schema.pattern_parse import QUANTIFIER
from espalier.constrained.schema.respell import class_end

_COUNT_WITH_SPACE = re.compile(r"\{\s*\d*\s*(?:,\s*\d*\s*)?\}")

MAX_REPEAT = 100_000
"""The most copies of one atom a regex's counted repetitions may ask for (:func:`repeat_size`).
Python's ``regex`` module writes a counted repeat of a literal out in full when it compiles:
``a{100000}`` takes 0.1 s and 24 MB, ``a{1000000}`` 0.6 s and 240 MB, ``a{100000000}`` tens of
GB (the server process was OOM-killed), all of it holding the GIL every other request's stream
needs. The backends refuse or blow up on such counts too."""
_FLAGS = re.compile(r"\(\?([a-zA-Z]*)[:)]")


def _outside(pattern: str) -> list[tuple[int, str]]:
    """``(index, char)`` of the characters outside escapes and ``[...]`` classes (a first ``]``
    is literal in a class, as Python reads it)."""
    out = []
    at, end = 0, len(pattern)
    while at < end:
        char = pattern[at]
        if char == "[":
            at = class_end(pattern, at)
        elif char == "\\":
            at = _escape_end(pattern, at)
        else:
            out.append((at, char))
            at += 1
    return out


def repeat_size(pattern: str) -> int:
    """The most copies of one atom that the counted repetitions (``{m}``, ``{m,}``, ``{m,n}``,
    ``{,n}``) of ``pattern`` ask for: the product of the larger bounds of the counts around it,
    through nested groups (``(?:a{100}){1000}``: 100,000). Linear in the pattern; it compiles
    nothing, so it can bound a pattern before anything does (:data:`MAX_REPEAT`)."""
    sizes = [1]  # the largest size inside each open group, the whole pattern first
    last, after, skip = 1, -1, -1
    for at, char in _outside(pattern):
        if at < skip:  # inside a count already read
            continue
        if at != after:  # a class or an escape came between: the atom before is one of those
            last = 1
        after = at + 1
        count = QUANTIFIER.match(pattern, at) if char == "{" else None
        if count is not None and (count.group(1) or count.group(3)):
            low, high = int(count.group(1) or 0), count.group(3)
            last *= max(low, int(high)) if count.group(2) and high else max(low, 1)
            sizes[-1] = max(sizes[-1], last)
            skip = after = count.end()
        elif char == "(":
            sizes.append(1)
        elif char == ")" and len(sizes) > 1:
            last = sizes.pop()
            sizes[-1] = max(sizes[-1], last)
        elif char not in "*+?|":
            last = 1
    return max(sizes)  # a closed group's size went into its parent; open ones stay here


def too_many_copies(pattern: str) -> str | None:
    """Why ``pattern`` is refused before anything compiles it (its :func:`repeat_size` is
    over :data:`MAX_REPEAT`), else None."""
    copies = repeat_size(pattern)
    if copies <= MAX_REPEAT:
        return None
    return (
        f"its counted repetitions ask for {copies} copies of one atom (nested counts multiply), "
        f"over the limit of {MAX_REPEAT}"
    )


_LARK_PIECE = re.compile(
    r'"(?:[^"\\\n]|\\.)*"i?|//[^\n]*|/((?:[^/\\\n]|\\.)+)/[imslux]*'
    r"|~\s*(\d+)(?:\s*\.\.\s*(\d+))?|([(\[])|([)\]])|(\w+)|.",
    re.DOTALL,
)
"""A Lark grammar's pieces: a string, a comment, a ``/regex/`` terminal (group 1), a count
``~ n`` / ``~ n..m`` (groups 2, 3), a group's opening or closing bracket (4, 5), a name (6)."""


def in_lark_terminals(source: str, misreading: Callable[[str], str | None]) -> str | None:
    """The first ``misreading`` (a backend's dialect check, e.g. :func:`rust_misreading`) of a
    Lark grammar's ``/regex/`` terminals, with the terminal and its line; None: none. Strings
    and ``//`` comments are skipped and ``\\/`` is read as ``/``: the terminals are read like
    a regex constraint (the ``regex`` module's syntax)."""
    for lexeme in _LARK_PIECE.finditer(source):
        pattern = lexeme.group(1)
        if pattern is None:
            continue
        misread = misreading(pattern.replace("\\/", "/"))
        if misread is not None:
            line = source.count("\n", 0, lexeme.start()) + 1
            return f"{misread} in the terminal /{pattern}/ on line {line}"
    return None


def lark_token_reference(source: str) -> str | None:
    """The first token reference of a Lark grammar (llguidance's ``<[43]>``, ``<[0-100]>``,
    ``<|name|>``: tokens by id or special name, not text) outside strings, ``/regex/``
    terminals and comments, with its line; None: none."""
    for lexeme in _LARK_PIECE.finditer(source):
        start = lexeme.start()
        if lexeme.group(0) == "<" and source[start + 1 : start + 2] in ("[", "|"):
            end = source.find(">", start)
            text = source[start : end + 1 if end >= 0 else start + 2]
            return f"{text} on line {source.count(chr(10), 0, start) + 1}"
    return None


_LARK_DEFINITION = re.compile(r"\s*[?!]?(\w+)(?:\.-?\d+)?\s*(?:\{[^}]*\})?\s*:(?!:)")


def _lark_bodies(source: str) -> dict[str, str]:
    """A Lark grammar's rule and terminal bodies by name, in order of first definition (a name
    defined again holds its last body); a ``%`` directive line ends a body."""
    bodies: dict[str, str] = {}
    current: str | None = None
    for line in source.splitlines():
        definition = _LARK_DEFINITION.match(line)
        if definition is not None:
            current = definition.group(1)
            bodies[current] = line[definition.end() :]
        elif line.lstrip().startswith("%"):
            current = None
        elif current is not None:
            bodies[current] += "\n" + line
    return bodies


def lark_repeat_size(source: str) -> int:
    """:func:`repeat_size` for a Lark grammar: counts ``~ n`` / ``~ n..m`` around items and
    groups, through rule references and inside ``/regex/`` terminals (a rule inside its own
    expansion counts once)."""
    bodies = _lark_bodies(source)
    sizes: dict[str, int] = {}

    def rule_size(name: str, active: frozenset[str]) -> int:
        if name in active or name not in bodies:
            return 1
        if name not in sizes:
            sizes[name] = _lark_body_size(bodies[name], lambda ref: rule_size(ref, active | {name}))
        return sizes[name]

    return max((rule_size(name, frozenset()) for name in bodies), default=1)


def lark_rules(source: str) -> dict[str, gbnf.Node]:
    """A Lark grammar's rules and terminals as :mod:`gbnf` nodes, for analyses of their shape
    alone (:func:`gbnf.shortest_lengths`): strings read as their text (a range as one
    character), ``/regex/`` terminals as empty texts, and so do names defined elsewhere
    (``%import``, ``%declare``, template parameters) and a whole body that uses llguidance's
    extensions (``%json``, token references): no claim is made on them."""
    bodies = _lark_bodies(source)
    return {name: _lark_node(body, bodies) for name, body in bodies.items()}


def _lark_node(body: str, defined: dict[str, str]) -> gbnf.Node:
    if "%" in body or "<" in body:
        return gbnf.Text("")
    pieces = [
        p for p in _LARK_PIECE.finditer(body) if not (p.group().isspace() or p.group()[:2] == "//")
    ]
    pos = 0

    def alternatives() -> gbnf.Node:
        nonlocal pos
        options = [sequence()]
        while pos < len(pieces) and pieces[pos].group() == "|":
            pos += 1
            options.append(sequence())
        return options[0] if len(options) == 1 else gbnf.Alt(tuple(options))

    def sequence() -> gbnf.Node:
        items: list[gbnf.Node] = []
        while pos < len(pieces) and pieces[pos].group() not in ("|", ")", "]"):
            item = atom()
            if item is not None:
                items.append(quantified(item))
        return gbnf.Seq(tuple(items))

    def atom() -> gbnf.Node | None:
        nonlocal pos
        piece = pieces[pos]
        pos += 1
        regex, _, _, opening, _, name = piece.groups()
        if opening is not None:
            inner = alternatives()
            pos += pos < len(pieces)  # the closing bracket
            return inner if opening == "(" else gbnf.Repeat(inner, 0, 1)
        if name is not None:
            return gbnf.Ref(name) if name in defined else gbnf.Text("")
        if piece.group() == "-" and pos < len(pieces) and pieces[pos].group() == ">":
            pos += 2  # an alias, ``-> name``: no part of the text
            return None
        if piece.group()[0] == '"':
            ahead = [p.group() for p in pieces[pos : pos + 3]]
            if ahead[:2] == [".", "."] and len(ahead) == 3 and ahead[2][0] == '"':
                pos += 3  # a range, "a".."z": one character
                return gbnf.Text("x")
            return gbnf.Text(re.sub(r"\\.", "x", piece.group().rstrip("i")[1:-1]))
        if regex is not None:
            return gbnf.Text("")  # its shortest text is not read here: counted as empty
        return None  # a template's braces and commas

    def quantified(node: gbnf.Node) -> gbnf.Node:
        nonlocal pos
        while pos < len(pieces):
            text, low, high = pieces[pos].group(), pieces[pos].group(2), pieces[pos].group(3)
            if text in ("?", "*", "+"):
                node = gbnf.Repeat(node, int(text == "+"), None)
            elif low is not None:
                node = gbnf.Repeat(node, int(low), int(high or low))
            else:
                break
            pos += 1
        return node

    node = alternatives()
    return node if pos == len(pieces) else gbnf.Text("")


def _lark_body_size(body: str, rule_size: Callable[[str], int]) -> int:
    groups = [1]  # the largest size inside each open group, the body first
    last = 1
    for piece in _LARK_PIECE.finditer(body):
        regex, low, high, opening, closing, name = piece.groups()
        text = piece.group()
        if regex is not None:
            last = repeat_size(regex.replace("\\/", "/"))
        elif low is not None:
            last *= max(int(low), int(high or 0), 1)
        elif opening is not None:
            groups.append(1)
            continue
        elif closing is not None and len(groups) > 1:
            last = groups.pop()
        elif name is not None:
            last = rule_size(name)
        elif text.startswith('"'):
            last = 1
        elif text.isspace() or text.startswith("//"):
            continue
        else:
            last = 1
            continue
        groups[-1] = max(groups[-1], last)
    return max(groups)


def _escape_end(pattern: str, at: int) -> int:
    """Where the escape at ``pattern[at]`` (a backslash) ends: past its braces for ``\\p{..}``,
    ``\\P{..}``, ``\\N{..}`` and ``\\x{..}`` (``\\p{L}+`` is not a possessive ``}+``), else
    past the escaped character."""
    if pattern[at + 1 : at + 2] in ("p", "P", "N", "x") and pattern[at + 2 : at + 3] == "{":
        close = pattern.find("}", at + 3)
        if close != -1:
            return close + 1
    return at + 2


def rust_misreading(pattern: str) -> str | None:
    """What Rust's regex syntax (llguidance, outlines-core) reads otherwise in ``pattern``."""
    if class_set_syntax(pattern):
        return "a '[', '&&', '--' or '~~' inside a class (Rust reads a nested class or a set)"
    plain = _outside(pattern)
    for (i, char), (j, after) in itertools.pairwise(plain):
        if char in "*+?}" and after == "+" and j == i + 1:
            return f"a possessive quantifier at column {i + 1} (Rust repeats the repetition)"
    for match in _COUNT_WITH_SPACE.finditer(pattern):
        if any(c.isspace() for c in match.group()) and (match.start(), "{") in plain:
            return f"a count with spaces at column {match.start() + 1} (a literal in Python)"
    for match in _FLAGS.finditer(pattern):
        if (match.start(), "(") in plain and set(match.group(1)) & set("RU"):
            return f"the flag group at column {match.start() + 1} (R and U differ in Rust)"
    return None


_ASSERTION_ESCAPES = frozenset("AzZbBG")


def without_end_anchors(pattern: str) -> str | None:
    """``pattern`` without a leading ``^`` and a trailing ``$`` (no-ops in a full match), or
    None when it asserts anything else (``^`` / ``$`` elsewhere, ``\\A \\z \\Z \\b \\B
    \\G``). For outlines-core, which compiles the regex followed by an end marker: a trailing
    ``$`` there never matches, so ``[a-z]+$`` could never end."""
    plain = _outside(pattern)
    at = 0
    while at < len(pattern) - 1:
        if pattern[at] == "[":
            at = class_end(pattern, at)
            continue
        if pattern[at] == "\\":
            if pattern[at + 1] in _ASSERTION_ESCAPES:
                return None
            at = _escape_end(pattern, at)
            continue
        at += 1
    start = 1 if plain and plain[0] == (0, "^") else 0
    end = (
        len(pattern) - 1
        if plain and plain[-1] == (len(pattern) - 1, "$") and len(pattern) > start
        else len(pattern)
    )
    if any(char in "^$" and start <= i < end for i, char in plain):
        return None
    return pattern[start:end]


_SURROGATE_ESCAPE = re.compile(
    r"(?<!\\)(?:\\\\)*\\"  # an escape (after an even run of backslashes)
    r"(?:u[dD][89a-fA-F][0-9a-fA-F]{2}|U0000[dD][89a-fA-F][0-9a-fA-F]{2}"
    r"|x\{0*[dD][89a-fA-F][0-9a-fA-F]{2}\})"
)
_SURROGATE = re.compile("[\ud800-\udfff]")


def names_surrogate(text: str) -> str | None:
    """Where ``text`` (a regex, a grammar's source, a schema string) names a surrogate code point
    (U+D800-U+DFFF) by an escape or holds one: no UTF-8 text holds one, so a grammar taking it
    matches nothing a model can write (xgrammar wrote the bytes of ``\\ud800``, not UTF-8)."""
    found = _SURROGATE_ESCAPE.search(text) or _SURROGATE.search(text)
    if found is None:
        return None
    return f"a surrogate code point at column {found.start() + 1} (no UTF-8 text holds one)"


def xgrammar_misreading(pattern: str) -> str | None:
    """What xgrammar reads otherwise in ``pattern`` (``.`` aside: see dot_without_newline)."""
    surrogate = names_surrogate(pattern)
    if surrogate is not None:
        return surrogate
    at = 0
    while at < len(pattern):
        char = pattern[at]
        if char == "\\" and at + 1 < len(pattern):
            why = _xgrammar_escape(pattern, at)
            if why is not None:
                return why
            at += 2
        elif char == "[":
            end = class_end(pattern, at)
            body = pattern[at + 1 : end - 1]
            if body.startswith(("\\^", "]", "^]")) or "[" in body:
                return f"the class at column {at + 1} (xgrammar reads its start otherwise)"
            for escape in re.finditer(r"\\.", body):
                letter = escape.group()[1]
                if letter in "SDWs" or (body.startswith("^") and letter in "dw"):
                    return f"\\{letter} in the class at column {at + 1} (not Python's class)"
                if letter.isdigit() or letter in "pP":  # [\012] took "2", [\p{Greek}] "G"
                    return f"\\{letter} in the class at column {at + 1} (xgrammar reads a literal)"
            at = end
        else:
            at += 1
    for i, char in _outside(pattern):
        if (char == "^" and i > 0) or (char == "$" and i < len(pattern) - 1):
            return f"an anchor inside the pattern at column {i + 1}"
    return None


def _xgrammar_escape(pattern: str, at: int) -> str | None:
    letter = pattern[at + 1]
    if letter.isdigit():
        return f"an octal or numbered escape at column {at + 1}"
    if letter in "SDWs":
        return f"\\{letter} at column {at + 1} (not Python's Unicode class there)"
    return None


def dot_without_newline(pattern: str) -> str:
    """``pattern`` with each ``.`` outside classes and escapes written ``[^\\n]``: Python's dot
    (no DOTALL flag), which xgrammar's ``.`` is not (it takes ``\\n``)."""
    plain = _outside(pattern)
    if any("s" in m.group(1) for m in _FLAGS.finditer(pattern) if (m.start(), "(") in plain):
        return pattern  # DOTALL: Python's dot takes "\n" too
    dots = [i for i, char in plain if char == "."]
    if not dots:
        return pattern
    out, last = [], 0
    for i in dots:
        out.append(pattern[last:i])
        out.append("[^\\n]")
        last = i + 1
    out.append(pattern[last:])
    return "".join(out)


LARK_COMMON = {
    # Lark's own (lark-parser common.lark): a quote, characters other than a newline (a
    # backslash escaping the next one), a quote. The backends' libraries took raw newlines.
    "ESCAPED_STRING": '/"(?:[^"\\\\\\n]|\\\\[^\\n])*"/',
}
"""Terminals of Lark's ``common`` library whose backend definitions read otherwise than Lark's,
spelled as Lark means them (:func:`own_common_terminals`)."""

_COMMON_IMPORT = re.compile(
    r"^[ \t]*%import[ \t]+common(?:\.(\w+)(?:[ \t]*->[ \t]*(\w+))?|[ \t]*\(([^)]*)\))[ \t]*$",
    re.MULTILINE,
)


def own_common_terminals(source: str) -> str:
    """``source`` (a Lark grammar) with each import of a :data:`LARK_COMMON` terminal from
    ``common`` (``%import common.NAME``, ``-> ALIAS``, or in a ``(A, B)`` list) replaced by its
    definition under the imported name; other imports are left to the backends."""

    def replace(match: re.Match[str]) -> str:
        single, alias, listed = match.groups()
        if single is not None:
            if single not in LARK_COMMON:
                return match.group(0)
            return f"{alias or single}: {LARK_COMMON[single]}"
        names = [n.strip() for n in listed.split(",") if n.strip()]
        own = [n for n in names if n in LARK_COMMON]
        if not own:
            return match.group(0)
        rest = [n for n in names if n not in LARK_COMMON]
        lines = [f"{n}: {LARK_COMMON[n]}" for n in own]
        if rest:
            lines.insert(0, f"%import common ({', '.join(rest)})")
        return "\n".join(lines)

    return _COMMON_IMPORT.sub(replace, source)


_OPEN_LOW_COUNT = re.compile(r"\{,(\d+)\}")


def backend_spelling(pattern: str) -> str:
    """``pattern`` (which Python's ``regex`` compiles) with the spellings no backend reads
    written the way they all do, meaning the same in a full match: ``{,n}`` is ``{0,n}``, and a
    leading ``\\A`` and a trailing ``\\Z`` / ``\\z`` are dropped (they hold at the ends of
    every full match)."""
    plain = {i for i, _ in _outside(pattern)}
    out, last = [], 0
    for match in _OPEN_LOW_COUNT.finditer(pattern):
        if match.start() in plain:
            out.append(pattern[last : match.start()] + f"{{0,{match.group(1)}}}")
            last = match.end()
    pattern = "".join(out) + pattern[last:]
    if pattern.startswith("\\A"):
        pattern = pattern[2:]
    if pattern.endswith(("\\Z", "\\z")) and not _escaped(pattern, len(pattern) - 2):
        pattern = pattern[:-2]
    return pattern


def _escaped(pattern: str, at: int) -> bool:
    """Whether the character at ``at`` follows an odd run of backslashes (is escaped)."""
    run = 0
    while at - run - 1 >= 0 and pattern[at - run - 1] == "\\":
        run += 1
    return run % 2 == 1


def python_reads(pattern: str) -> bool:
    """Whether Python's ``regex`` module compiles ``pattern``: a backend's parse error on such
    a pattern is the backend's limit (unsupported), not a fault of the pattern (invalid)."""
    import regex

    try:
        regex.compile(pattern)
    except (regex.error, RecursionError):
        return False
    return True
