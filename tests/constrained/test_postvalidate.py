"""Post-validation of final outputs against the full constraint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from espalier.constrained.postvalidate import PostValidation, postvalidate, validate_instance
from espalier.constrained.schema.refs import directory_registry
from espalier.constrained.spec import GrammarKind, GrammarSpec

SUITE = Path(__file__).resolve().parents[3] / "shared" / "conformance" / "json-schema-test-suite"


def check(schema: Any, text: str, **kwargs: Any) -> PostValidation:
    return postvalidate(GrammarSpec.json_schema(schema), text, **kwargs)


def test_valid_output() -> None:
    assert check({"type": "object", "required": ["a"]}, '{"a": 1}') == PostValidation(True, True)


def test_errors_are_prefixed_by_json_pointer() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"maximum": 3}}}}
    result = check(schema, '{"a": [1, 5]}')
    assert result.checked and not result.valid
    assert result.errors[0].startswith("/a/1: ")


def test_root_errors_use_slash() -> None:
    result = check({"type": "string"}, "1")
    assert result.errors and result.errors[0].startswith("/: ")


def test_formats_are_asserted() -> None:
    schema = {"type": "string", "format": "date"}
    assert check(schema, '"2020-02-29"').valid
    assert not check(schema, '"2021-02-29"').valid
    assert not check({"format": "email"}, '"no-at-sign"').valid


def test_older_draft_is_respected() -> None:
    # Draft 7: keywords next to $ref are ignored; Draft 2020-12 applies them
    body = {"definitions": {"s": {"type": "string"}}, "$ref": "#/definitions/s", "maxLength": 1}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **body}
    assert check(draft7, '"abc"').valid
    assert not check(body, '"abc"').valid


def test_strict_json_rejects_duplicates_and_constants() -> None:
    for text in ('{"a": 1, "a": 2}', "NaN", "[Infinity]", "{", ""):
        result = check({}, text)
        assert result.checked and not result.valid, text


def test_unicode_property_patterns_work() -> None:
    schema = {"type": "string", "pattern": "^\\p{L}+$"}
    assert check(schema, '"héllo"').valid
    assert not check(schema, '"h3llo"').valid


def test_remote_refs_come_from_the_registry() -> None:
    if not (SUITE / "remotes").is_dir():
        pytest.skip("JSON Schema Test Suite not present")
    registry = directory_registry(SUITE / "remotes")
    schema = {"$ref": "http://localhost:1234/integer.json"}
    assert check(schema, "1", registry=registry).valid
    assert not check(schema, '"a"', registry=registry).valid


def test_unresolvable_ref_gives_no_verdict() -> None:
    result = check({"$ref": "http://example.invalid/x.json"}, "1")
    assert not result.checked


def test_regex_full_match() -> None:
    spec = GrammarSpec.regex("[a-c]+")
    assert postvalidate(spec, "abc").valid
    assert not postvalidate(spec, "abcd").valid
    assert not postvalidate(GrammarSpec(GrammarKind.REGEX, "("), "(").checked  # past the check


def test_choice_and_any_json() -> None:
    spec = GrammarSpec.choice(["yes", "no"])
    assert postvalidate(spec, "no").valid and not postvalidate(spec, "maybe").valid
    assert postvalidate(GrammarSpec.any_json(), "[1, {}]").valid
    assert not postvalidate(GrammarSpec.any_json(), "[1,").valid


def test_grammar_kinds_need_a_replay() -> None:
    spec = GrammarSpec.lark('start: "a"+')
    assert postvalidate(spec, "aa") == PostValidation(
        False, False, ("/: no independent validator for this grammar kind",)
    )
    assert postvalidate(spec, "aa", replay=lambda text: set(text) == {"a"}).valid
    assert not postvalidate(spec, "ab", replay=lambda text: set(text) == {"a"}).valid


def test_a_lark_grammar_counting_tokens_is_not_judged_from_its_text() -> None:
    """Its text re-tokenized counts other tokens than the generation did: the replay said
    'not accepted' for outputs that followed the grammar."""
    spec = GrammarSpec.lark("start: foo\nfoo[max_tokens=2]: /[a-z]+/")
    result = postvalidate(spec, "remarkableraiser", replay=lambda text: False)
    assert not result.checked and "max_tokens" in result.errors[0]
    plain = GrammarSpec.lark("start: /[a-z]+/")
    assert not postvalidate(plain, "ab", replay=lambda text: False).valid


def test_replay_with_a_real_matcher(toy_tokenizer: Any) -> None:
    from espalier.constrained.compile import compile_grammar
    from espalier.constrained.postvalidate import replay_with

    spec = GrammarSpec.lark('start: "a"+ "b"')
    compiled, _ = compile_grammar(spec, toy_tokenizer, "llguidance")
    replay = replay_with(compiled, toy_tokenizer)
    assert postvalidate(spec, "aab", replay=replay).valid
    assert not postvalidate(spec, "aa", replay=replay).valid


def test_a_spec_builds_its_validator_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Outputs of one spec (and of another spec with the same text) share a validator built
    # once from the spec's text, which is not parsed again per output; another schema builds
    # its own. Verdicts are those of validate_instance on the parsed schema.
    from espalier.constrained import postvalidate as pv

    built: list[Any] = []
    build = pv._build_validator

    def counting(schema: Any, registry: Any) -> Any:
        built.append(schema)
        return build(schema, registry)

    def unparsed(_: GrammarSpec) -> Any:
        raise AssertionError("the spec's schema parsed per output")

    monkeypatch.setattr(pv, "_build_validator", counting)
    monkeypatch.setattr(pv, "_validators", type(pv._validators)())
    monkeypatch.setattr(GrammarSpec, "schema", property(unparsed))
    schema = {"type": "object", "properties": {"n": {"maximum": 3}}, "required": ["n"]}
    outputs = ['{"n": 1}', '{"n": 7}', "{}", '{"n": 2}']
    got = [postvalidate(GrammarSpec.json_schema(schema), text) for text in outputs]
    assert [r.valid for r in got] == [True, False, False, True]
    assert built == [schema]
    assert not check({"type": "string"}, "1").valid
    assert built == [schema, {"type": "string"}]
    for text, result in zip(outputs, got):
        assert result == pv.validate_instance(schema, pv.parse_strict_json(text))


@pytest.mark.parametrize(
    ("divisor", "value", "valid"),
    [(0.1, 1.9, True), (1e-5, 1.0, True), (0.01, 1056568.39, True), (0.1, 1.95, False),
     (3, 10, False), (3, 9, True), (1e-308, 1e308, True), (0.7, 1e308, False)],
)  # fmt: skip
def test_multiple_of_reads_numbers_as_written(divisor: float, value: float, valid: bool) -> None:
    # jsonschema's float division called 1.9 no multiple of 0.1
    assert validate_instance({"multipleOf": divisor}, value).valid is valid


def test_a_schema_too_costly_to_check_leaves_the_output_unchecked() -> None:
    import time

    # 40 levels of allOf over two refs to the next level: 2**40 visits for jsonschema
    defs = {f"l{i}": {"allOf": [{"$ref": f"#/$defs/l{i + 1}"}] * 2} for i in range(40)}
    defs["l40"] = {"type": "integer"}
    spec = GrammarSpec.json_schema({"$defs": defs, "$ref": "#/$defs/l0"})
    started = time.monotonic()
    result = postvalidate(spec, "1")
    assert not result.checked and "TimeoutError" in result.errors[0]
    assert time.monotonic() - started < 30  # unbounded before (the server's reader thread)
    # and a backtracking patternProperties regex over a long key
    schema = {"type": "object", "patternProperties": {"^(a|aa)+$": {"type": "integer"}}}
    result = postvalidate(GrammarSpec.json_schema(schema), json.dumps({"a" * 60 + "b": 1}))
    assert not result.checked
    # a validator used outside a check afterwards is not timed out by a stale deadline
    assert validate_instance({"type": "integer"}, 1).valid
