"""A caller's schema never causes file or network access, and bad schemas are refused up front.

The no-I/O tests run every path a schema takes in the server (admission, compile with weakening,
post-validation) under a process audit hook, with a bait file and a listening bait port, for each
ref keyword and for ``$schema`` with a URL.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from espalier.constrained import gbnf
from espalier.constrained.compile import compile_grammar
from espalier.constrained.errors import EmptyLanguageError, GrammarError, InvalidGrammarError
from espalier.constrained.grammar_limits import check_alternatives, count_alternatives
from espalier.constrained.postvalidate import postvalidate
from espalier.constrained.schema.guard import (
    MAX_NAMES,
    MAX_NAMES_PER_OBJECT,
    admit_schema,
    json_depth,
)
from espalier.constrained.spec import GrammarSpec

_SEEN: list[tuple[str, str]] = []
_WATCH: dict[str, str] = {}  # "path" -> bait file, "port" -> bait port


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _WATCH:
        return
    if event == "open" and args and _WATCH["path"] in str(args[0]):
        _SEEN.append(("open", str(args[0])))
    elif event == "socket.connect" and _WATCH["port"] in repr(args[1]):
        _SEEN.append(("connect", repr(args[1])))


sys.addaudithook(_audit)  # hooks cannot be removed: it records only while _WATCH is set


@pytest.fixture
def bait(tmp_path: Path) -> Iterator[tuple[str, str, list[int]]]:
    """(file URI, http URL, [connections accepted]) with the audit hook watching both."""
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"type": "string", "description": "TOP-SECRET"}))
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = [0]

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted[0] += 1
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    _SEEN.clear()
    _WATCH.update(path=str(secret), port=str(port))
    yield secret.as_uri(), f"http://127.0.0.1:{port}/schema.json", accepted
    _WATCH.clear()
    server.close()


def ref_schemas(file_uri: str, url: str) -> dict[str, dict[str, Any]]:
    draft2019 = "https://json-schema.org/draft/2019-09/schema"
    return {
        "$ref file": {"properties": {"a": {"$ref": file_uri}}},
        "$ref http": {"$ref": url},
        "$dynamicRef file": {"$dynamicRef": file_uri},
        "$dynamicRef http": {"type": "object", "properties": {"x": {"$dynamicRef": url}}},
        "$recursiveRef http": {"$schema": draft2019, "$recursiveRef": url},
        "$schema http": {"$schema": url, "type": "string"},
        "$schema file": {"$schema": file_uri, "type": "string"},
    }


def test_no_ref_keyword_opens_a_file_or_a_socket(
    bait: tuple[str, str, list[int]], toy_tokenizer: Any
) -> None:
    file_uri, url, accepted = bait
    for name, schema in ref_schemas(file_uri, url).items():
        text = json.dumps(schema)
        if name.startswith("$schema"):
            assert admit_schema(text) == schema  # an unknown dialect is Draft 2020-12: no fetch
        else:
            with pytest.raises(InvalidGrammarError) as info:
                admit_schema(text)
            assert info.value.pointer is not None and info.value.pointer.endswith(name.split()[0])
        # the paths behind admission must not fetch either (CLI, conformance, weakening)
        spec = GrammarSpec.json_schema(schema)
        with contextlib.suppress(GrammarError):
            compile_grammar(spec, toy_tokenizer, allow_weakening=True)
        result = postvalidate(spec, '"x"')
        assert "TOP-SECRET" not in " ".join(result.errors)
    assert _SEEN == [] and accepted == [0]


def test_refs_inside_the_schema_and_to_bundled_metaschemas_resolve() -> None:
    schemas = [
        {"$defs": {"x": {"$anchor": "foo", "type": "string"}}, "$ref": "#foo"},
        {"$dynamicAnchor": "node", "properties": {"c": {"$dynamicRef": "#node"}}},
        {
            "$id": "https://example.com/root.json",
            "$defs": {"a": {"$id": "a.json", "type": "integer"}},
            "properties": {"x": {"$ref": "a.json"}},
        },
        {"$ref": "https://json-schema.org/draft/2020-12/schema"},
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"a": {"type": "string"}},
            "$ref": "#/definitions/a",
        },
    ]
    for schema in schemas:
        assert admit_schema(json.dumps(schema)) == schema


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"type": "string", "minLength": -1}, "/minLength"),
        ({"properties": {"a": {"type": "strin"}}}, "/properties/a/type"),
        ({"$schema": "http://json-schema.org/draft-04/schema#", "required": []}, "/required"),
        ({"$ref": "#/$defs/missing"}, "/$ref"),
        ({"$schema": 7}, "/$schema"),
        # a backend's own message pointed into its wrapper ("Unclosed '[' at position 18")
        ({"type": "string", "pattern": "[a-"}, "/pattern"),
        (
            {"properties": {"q": {"patternProperties": {"(": {}}}}},
            "/properties/q/patternProperties/(",
        ),
    ],
)
def test_invalid_schemas_are_refused_with_a_pointer(schema: Any, pointer: str) -> None:
    with pytest.raises(InvalidGrammarError) as info:
        admit_schema(json.dumps(schema))
    assert info.value.pointer == pointer
    if "pattern" in pointer.lower():
        assert "at position" in str(info.value)


def test_nesting_is_bounded_before_parsing() -> None:
    assert json_depth('{"a": "[[[{{", "b": [1, {"c": "\\"]"}]}') == 3
    for text in ("[" * 100_000, '{"items":' * 300 + "{}" + "}" * 300):
        with pytest.raises(InvalidGrammarError, match="levels deep"):
            admit_schema(text)
    with pytest.raises(InvalidGrammarError, match="not valid JSON"):
        admit_schema('{"a": ')


def test_empty_languages_are_refused_at_compile(toy_tokenizer: Any) -> None:
    specs = [
        GrammarSpec.json_schema({"$ref": "#"}),
        GrammarSpec.json_schema(
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        ),
    ]
    for spec in specs:
        for backend in ("auto", "llguidance", "xgrammar"):
            with pytest.raises(InvalidGrammarError):
                compile_grammar(spec, toy_tokenizer, backend)
    compile_grammar(GrammarSpec.ebnf('root ::= "a" root | "b"'), toy_tokenizer, "llguidance")


@pytest.mark.parametrize(
    "grammar",
    [
        "root ::= root",
        'root ::= a\na ::= "x" a',  # the first mask allows x: no output ends
        'root ::= "a"* b\nb ::= "c" b | b "d"',
        'root ::= ("x" root)+',
    ],
)
def test_gbnf_whose_root_derives_no_finite_text_is_refused_before_any_backend(
    grammar: str,
) -> None:
    """A held-out sweep: ``a ::= "x" a`` compiled on every backend, and a generation with it
    on xgrammar grew the engine process to 16 GB until the OOM killer ended it."""
    with pytest.raises(EmptyLanguageError, match="matches no finite text"):
        GrammarSpec.ebnf(grammar)
    for productive in ('root ::= a\na ::= "x" a | "y"', 'root ::= ("x" root)*'):
        assert GrammarSpec.ebnf(productive).source == productive


@pytest.mark.parametrize(
    "grammar",
    [
        "start: start",
        'start: a\na: "x" a',  # compiled; llguidance then ran out of parser items
        'start: ("x" start)+',
        'start: a b\na: "x"\nb: b "y" -> tail',
        'start: A\nA: "x" A',
        'start: a ~ 2\na: "x" a',
    ],
)
def test_lark_whose_start_derives_no_finite_text_is_refused_before_any_backend(
    grammar: str,
) -> None:
    with pytest.raises(EmptyLanguageError, match="rule 'start' never ends"):
        GrammarSpec.lark(grammar)


@pytest.mark.parametrize(
    "grammar",
    [
        'start: a\na: "x" a | "y"',
        'start: ("x" start)*',
        'start: [start] "x"',
        'start: a ~ 0..2\na: "x" a',
        'start: "a".."z" -> letter',
        "start: WORD\n%import common.WORD",  # defined elsewhere: no claim
        'start: %json {"type": "object"} start',  # llguidance's extension: no claim
        'start: _sep{a, ","}\n_sep{x, sep}: x (sep x)*\na: "a"',
    ],
)
def test_lark_that_can_end_is_kept(grammar: str) -> None:
    assert GrammarSpec.lark(grammar).source == grammar


def _doubling(depth: int, lark: bool) -> str:
    if lark:
        rules = "".join(f"r{i}: r{i + 1} r{i + 1}\n" for i in range(depth))
        return f'start: r0\n{rules}r{depth}: "a"\n'
    rules = "".join(f"r{i} ::= r{i + 1} r{i + 1}\n" for i in range(depth))
    return f'root ::= r0\n{rules}r{depth} ::= "a"\n'


@pytest.mark.parametrize("lark", [False, True])
def test_a_grammar_whose_shortest_text_is_too_long_is_refused(lark: bool) -> None:
    """A held-out sweep: each rule doubling the next, 26 to 60 deep, passed the repeat count
    (no counted repeat) and one request grew the engine to 16 GB until the kernel killed it,
    failing every request in flight; at 22 deep one request took 2.3 GB and 18 s."""
    spec = GrammarSpec.lark if lark else GrammarSpec.ebnf
    for depth in (18, 60):
        with pytest.raises(InvalidGrammarError, match=r"shortest text rule .* is over 250000"):
            spec(_doubling(depth, lark))
    assert spec(_doubling(17, lark))  # 131,072 characters
    ranges = "start: r0\n" + "".join(f"r{i}: r{i + 1} r{i + 1}\n" for i in range(17))
    assert GrammarSpec.lark(ranges + 'r17: "a".."z"\n')  # a range is one character


def test_a_chain_of_rules_each_defined_before_the_one_it_needs() -> None:
    """Each rule turns productive only after the one defined after it: the check looks at a
    rule again only when one it needs turned productive (it went over every rule each time,
    and a chain of 400 beside 40,000 other rules held the server's GIL for 2.1 s)."""
    chain = "".join(f"r{i} ::= r{i + 1}\n" for i in range(400))
    rules = gbnf.parse(f'root ::= r0\n{chain}r400 ::= "x"\nf ::= "y"\n')
    assert gbnf.shortest_lengths(rules)["root"] == 1
    looped = gbnf.shortest_lengths({**rules, "r400": gbnf.Ref("r0")})
    assert [name for name, n in looped.items() if n is None] == list(rules)[:402]


def test_alternatives_are_counted_outside_literals() -> None:
    lark = 'start: "a|b" | /x|y/ | c  // one | two\nc: "[|]" | "d"'
    assert count_alternatives(GrammarSpec.lark(lark)) == 3
    gbnf = 'root ::= "a|b" | [|x] | c  # | comment\nc ::= "d" | "e"'
    assert count_alternatives(GrammarSpec.ebnf(gbnf)) == 3
    big = GrammarSpec.lark("start: " + " | ".join(f'"{i}"' for i in range(2001)))
    with pytest.raises(InvalidGrammarError, match="2000 alternatives"):
        check_alternatives(big)
    check_alternatives(GrammarSpec.choice([f"o{i}" for i in range(1024)]))


def test_a_deeply_nested_output_gets_no_verdict_instead_of_a_crash() -> None:
    deep = "[" * 20_000 + "]" * 20_000  # a model may emit this under any_json
    for spec in (GrammarSpec.any_json(), GrammarSpec.json_schema({"type": "array"})):
        result = postvalidate(spec, deep)
        assert not result.checked and "nested too deeply" in result.errors[0]


def test_property_names_are_bounded_per_object_and_in_all() -> None:
    """20,000 required names (a held-out sweep) took the engine process past 8 GB in the
    closing search's matcher forks, and it aborted with every open request; such a schema is
    refused at admission now, naming the object."""
    names = [f"r{i}" for i in range(MAX_NAMES_PER_OBJECT + 1)]
    with pytest.raises(InvalidGrammarError, match="property names") as info:
        admit_schema(json.dumps({"properties": {"a": {"type": "object", "required": names}}}))
    assert info.value.pointer == "/properties/a"
    spread = {
        "properties": {
            f"o{j}": {"properties": {f"p{j}_{i}": {} for i in range(MAX_NAMES_PER_OBJECT)}}
            for j in range(MAX_NAMES // MAX_NAMES_PER_OBJECT + 1)
        }
    }
    with pytest.raises(InvalidGrammarError, match="in the schema"):
        admit_schema(json.dumps(spread))
    # listed and required together count once per name
    both = {"properties": {n: {} for n in names[:-1]}, "required": names[:-1]}
    admit_schema(json.dumps(both))
