"""No key repeats in a structural tag's JSON values either (``keys.c``'s frames: one value, or
each tag of a tag list), and where the tracker cannot follow a value (a value the grammar may
start anywhere, one inside a Lark grammar), strict mode refuses a schema whose objects may
repeat a key instead of letting the repeat through.

The held-out sweep of session 50 got ``{"a": 172, "a": 0}`` out of a structural tag and a Lark
``%json`` block (``patternProperties: {"^[ab]$": ...}``, ``minProperties: 2``), marked valid.
Its fix refused tag lists with open objects (vLLM's tool-call example) until frames rearmed.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from espalier.constrained import bitmask as bm
from espalier.constrained.compile import compile_grammar
from espalier.constrained.conformance import grammar_accepts
from espalier.constrained.errors import SchemaNotEnforceableError
from espalier.constrained.keys import UniqueKeysMatcher, with_unique_keys
from espalier.constrained.keys.frames import MAX_FRAME_BYTES, scan_automaton
from espalier.constrained.keys.native import FrameTable, KeyTables, KeyTracker
from espalier.constrained.postvalidate import postvalidate, replay_with
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.structural_tag import after_reasoning, structural_tag_spec

AB = {  # free keys: 702 names, too many to list as properties (``finite_names``)
    "type": "object",
    "patternProperties": {"^[a-z]{1,2}$": {"type": "integer"}},
    "additionalProperties": False,
}
OPEN = {"type": "object", "properties": {"x": {"type": "integer"}}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _tag(fmt: dict[str, Any]) -> GrammarSpec:
    return structural_tag_spec({"type": "structural_tag", "format": fmt})


def _json(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema}


FRAMED = [
    ("root", _tag(_json(AB)), "", '{"a": 1, "b": 2}', '{"a": 1, "a": 2}'),
    (
        "tag",
        _tag({"type": "tag", "begin": "<j>", "content": _json(AB), "end": "</j>"}),
        "<j>",
        '<j>{"a": 1, "b": 2}</j>',
        '<j>{"b": 1, "b": 2}</j>',
    ),
    (
        "reasoning",
        after_reasoning(GrammarSpec.json_schema(OPEN), "</think>"),
        "</think>",
        'a {"x": 1, "x": 2} </th</think>{"x": 1, "y": {"x": 1}}',
        '{"y": 1}</think>{"x": 1, "y": {"z": 1, "z": 2}}',
    ),
    (
        "const",
        _tag(
            {
                "type": "sequence",
                "elements": [{"type": "const_string", "value": "{A}"}, _json(OPEN)],
            }
        ),
        "{A}",
        '{A}{"x": 1, "y": [{"x": 1}]}',
        '{A}{"x": 1, "x": 3}',
    ),
    (  # vLLM's tool-call example: free text, then tags; a repeat in the second value
        "triggered",
        _tag(
            {
                "type": "triggered_tags",
                "triggers": ["<function="],
                "tags": [
                    {"begin": "<function=w>", "content": _json(WEATHER), "end": "</function>"},
                    {"begin": "<function=o>", "content": _json(OPEN), "end": "</function>"},
                ],
            }
        ),
        "<function=o>",
        'hi {"x": 1, "x": 1} <function=o>{"x": 1, "y": 2}</function> and'
        '<function=w>{"city": "a", "x": 1}</function>',
        '<function=o>{"x": 1}</function><function=w>{"city": "a", "z": 1, "z": 2}</function>',
    ),
    (
        "separated",
        _tag(
            {
                "type": "tags_with_separator",
                "separator": ",",
                "tags": [{"begin": "<t>", "content": _json(OPEN), "end": "</t>"}],
            }
        ),
        "<t>",
        '<t>{"x": 1, "y": 2}</t>,<t>{"x": 2, "y": 1}</t>',
        '<t>{"x": 1}</t>,<t>{"y": 1, "y": 2}</t>',
    ),
    (
        "reasoning-tags",
        after_reasoning(
            _tag(
                {
                    "type": "triggered_tags",
                    "triggers": ["<f"],
                    "tags": [{"begin": "<f>", "content": _json(OPEN), "end": "</f>"}],
                }
            ),
            "</think>",
        ),
        "<f>",
        '<f>{"x": 1, "x": 2}</f></think>ok <f>{"x": 1, "z": {"x": 1}}</f>',
        '</think><f>{"x": 1}</f> <f>{"y": 1, "y": 2}</f>',
    ),
]


@pytest.mark.parametrize(("name", "spec", "frame", "good", "repeat"), FRAMED)
def test_a_framed_value_never_repeats_a_key(
    name: str, spec: GrammarSpec, frame: str, good: str, repeat: str, toy_tokenizer: Any
) -> None:
    compiled, report = compile_grammar(spec, toy_tokenizer)
    assert report.weakened == ()
    matcher = with_unique_keys(compiled.spec, compiled.matcher(), toy_tokenizer)
    assert isinstance(matcher, UniqueKeysMatcher)
    assert grammar_accepts(compiled, toy_tokenizer, good)
    assert not grammar_accepts(compiled, toy_tokenizer, repeat)
    # the replay of the post-validation has the tracker too: a repeat is not called valid
    replay = replay_with(compiled, toy_tokenizer)
    assert postvalidate(compiled.spec, good, replay=replay).valid
    assert not postvalidate(compiled.spec, repeat, replay=replay).valid


@pytest.mark.parametrize(("name", "spec", "frame", "good", "repeat"), FRAMED[:4])
def test_random_framed_outputs_never_repeat_a_key(
    name: str, spec: GrammarSpec, frame: str, good: str, repeat: str, toy_tokenizer: Any
) -> None:
    """Random walks over the wrapped matcher's rows (quotes favoured, so keys come often):
    every finished output's JSON value holds no repeated key."""
    compiled, _ = compile_grammar(spec, toy_tokenizer)
    rng = random.Random(5)
    stops = set(toy_tokenizer.stop_token_ids)
    prefix = toy_tokenizer.encode(frame + "{") if frame else []
    finished = 0
    for _ in range(12):
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), toy_tokenizer)
        assert matcher.accept_tokens(prefix) == len(prefix)
        tokens = list(prefix)
        while len(tokens) < 80 and not matcher.is_terminated():
            allowed = _allowed(matcher, toy_tokenizer.vocab_size)
            keyish = [t for t in allowed if toy_tokenizer.token_bytes[t][:1] in b'"ab,xy}']
            late = len(tokens) > 40 and [t for t in allowed if t in stops]
            token = rng.choice(late or (keyish if keyish and rng.random() < 0.85 else allowed))
            if not matcher.accept(token):  # an exhausted key language ("a", "b"): a dead end
                assert (matcher.refusal() or "").startswith("duplicate key"), matcher.refusal()
                break
            tokens.append(token)
        if not matcher.is_terminated():
            continue
        text = b"".join(toy_tokenizer.token_bytes[t] for t in tokens if t not in stops).decode()
        value = text[text.index(frame) + len(frame) :] if frame else text
        end = value.rfind("}") + 1
        json.loads(value[:end], object_pairs_hook=_unique)
        finished += 1
    assert finished > 0


@pytest.mark.parametrize(("name", "spec", "frame", "good", "repeat"), FRAMED[4:])
def test_random_tag_lists_never_repeat_a_key(
    name: str, spec: GrammarSpec, frame: str, good: str, repeat: str, toy_tokenizer: Any
) -> None:
    """Random walks over a tag list's wrapped matcher (outside values a begin is written now
    and then, keys favoured inside them): every value read after a begin holds no repeated
    key, the later ones too."""
    compiled, _ = compile_grammar(spec, toy_tokenizer)
    begins = ("<function=w>", "<function=o>", "<t>", "<f>", "</think>")
    stops = set(toy_tokenizer.stop_token_ids)
    rng = random.Random(7)
    values = 0
    for _ in range(10):
        matcher = with_unique_keys(compiled.spec, compiled.matcher(), toy_tokenizer)
        text = ""
        for _ in range(160):
            if matcher.is_terminated():
                break
            if text.count("{") <= text.count("}") and rng.random() < 0.3:
                run = toy_tokenizer.encode_text(rng.choice(begins) + rng.choice(["", "{"]))
                done = matcher.accept_tokens(run)
                if done == len(run):
                    text += _text(toy_tokenizer, run)
                    continue
                matcher.rollback(done)
            allowed = [t for t in _allowed(matcher, toy_tokenizer.vocab_size) if t not in stops]
            if not allowed:
                break
            inside = text.count("{") > text.count("}")
            quotes = [t for t in allowed if toy_tokenizer.token_bytes[t][:1] == b'"']
            keyish = [t for t in allowed if toy_tokenizer.token_bytes[t][:1] in b"xyz0,:}"]
            r = rng.random()
            token = rng.choice(
                quotes if inside and quotes and r < 0.4
                else keyish if inside and keyish and r < 0.85
                else allowed
            )  # fmt: skip
            if not matcher.accept(token):
                assert (matcher.refusal() or "").startswith("duplicate key"), matcher.refusal()
                break
            text += _text(toy_tokenizer, [token])
        values += _check_values(text, "</think>" if name == "reasoning-tags" else "", begins[:-1])
    assert values >= 5


def _text(tokenizer: Any, tokens: list[int]) -> str:
    return b"".join(tokenizer.token_bytes[t] for t in tokens).decode("utf-8", "replace")


def _check_values(text: str, gate: str, begins: tuple[str, ...]) -> int:
    """Read each JSON value that follows a begin after the gate's first occurrence (text
    between values skipped) and check its keys; how many complete values there were."""
    decoder = json.JSONDecoder(object_pairs_hook=_unique)
    if gate not in text:
        return 0
    at = text.index(gate) + len(gate)
    count = 0
    while True:
        ends = [(text.find(b, at) + len(b)) for b in begins if text.find(b, at) >= 0]
        if not ends:
            return count
        start = min(ends)
        try:
            _, at = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return count  # the last value, cut by the walk's length
        count += 1


def _allowed(matcher: Any, vocab: int) -> list[int]:
    row = bm.allocate(1, vocab, fill=0)
    matcher.fill_bitmask(row, 0)
    return np.flatnonzero(bm.unpack_allowed(row[0], vocab)).tolist()


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


def test_the_frame_is_found_across_tokens_and_partial_matches(toy_tokenizer: Any) -> None:
    """The frame's first occurrence ends the free text even where a partial match came first
    (``</th</think>``), a repeat before it is free text, and after the value's root closes
    nothing is read (a tag's end, more text); rollback restores where the frame stood."""
    frames = FrameTable(scan_automaton(b"</think>", (), False))
    tracker = KeyTracker(KeyTables(toy_tokenizer.token_bytes), None, frames)
    before = toy_tokenizer.encode_text('{"a": 1, "a": 2} </th</think>{"a": 1, "b": {"a": ')
    assert tracker.accept_tokens(before) == len(before)
    repeat = toy_tokenizer.encode_text('1}, "a"')
    assert tracker.clean_prefix(repeat) < len(repeat)  # the state is left as it was
    done = toy_tokenizer.encode_text('1}, "c": 2} {"c": 1, "c": 2}')
    assert tracker.accept_tokens(done) == len(done)
    tracker.rollback(len(done))
    assert tracker.clean_prefix(repeat) < len(repeat)
    fork = tracker.fork()
    assert fork.accept_tokens(done) == len(done)
    assert tracker.clean_prefix(repeat) < len(repeat)
    tracker.rollback(tracker.accepted)
    assert tracker.accepted == 0
    assert tracker.accept_tokens(before) == len(before)
    assert tracker.clean_prefix(repeat) < len(repeat)
    with pytest.raises(ValueError, match="frames of more than"):
        scan_automaton(b"x" * (MAX_FRAME_BYTES + 1), (), False)


def test_a_tag_list_rearms_after_each_value(toy_tokenizer: Any) -> None:
    """After a value's root closes, the scan looks for the next begin: a repeat in a later
    value is refused, text between values is not read, and rollback across values restores
    the scan."""
    frames = FrameTable(scan_automaton(b"", (b"<f=a>", b"<f=b>"), True))
    tracker = KeyTracker(KeyTables(toy_tokenizer.token_bytes), None, frames)
    first = toy_tokenizer.encode_text(
        'x {"k": 1, "k": 2} <f=a>{"k": 1}</f> {"k": 1, "k": 2} <f=b>{"k": '
    )
    assert tracker.accept_tokens(first) == len(first)
    repeat = toy_tokenizer.encode_text('1, "k"')
    assert tracker.clean_prefix(repeat) < len(repeat)
    rest = toy_tokenizer.encode_text('1, "j": 2}</f><f=a>"a string <f=b>{}" <f=a>{"j": 1, "j"')
    assert tracker.accept_tokens(rest) < len(rest)
    done = tracker.accepted
    tracker.rollback(done - len(first))
    assert tracker.clean_prefix(repeat) < len(repeat)


@pytest.mark.parametrize("scalar", ['"a <t>{"', "12", "-1.5e3", "true", "null"])
def test_a_root_scalar_ends_where_it_cannot_go_on(scalar: str, toy_tokenizer: Any) -> None:
    """A tag's value that is a string, number or literal ends at its closing quote or at the
    first byte that cannot continue it (whitespace too): a begin that starts right there is
    found, and a begin inside a root string starts nothing."""
    frames = FrameTable(scan_automaton(b"", (b" <t>",), True))
    tracker = KeyTracker(KeyTables(toy_tokenizer.token_bytes), None, frames)
    head = toy_tokenizer.encode_text(f' <t>{scalar} <t>{{"k": 1, ')
    assert tracker.accept_tokens(head) == len(head)
    repeat = toy_tokenizer.encode_text('"k"')
    assert tracker.clean_prefix(repeat) < len(repeat)


def test_tag_lists_whose_begins_could_be_found_elsewhere_are_not_followed(
    toy_tokenizer: Any,
) -> None:
    """An end that holds or starts a trigger, or a begin inside another, would make the scan
    find a begin where the grammar has none: such lists are refused in strict mode, as
    before."""
    for tags, triggers in (
        ([{"begin": "<f>", "content": _json(OPEN), "end": "</f><"}], ["<f"]),
        ([{"begin": "<f>", "content": _json(OPEN), "end": "</f><f"}], ["<f"]),
        ([{"begin": "<f>", "content": _json(OPEN), "end": "."},
          {"begin": "<f>>", "content": _json(OPEN), "end": "."}], ["<f"]),
    ):  # fmt: skip
        spec = _tag({"type": "triggered_tags", "triggers": triggers, "tags": tags})
        with pytest.raises(SchemaNotEnforceableError, match="additionalProperties"):
            compile_grammar(spec, toy_tokenizer)


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        (
            _tag(
                {
                    "type": "triggered_tags",
                    "triggers": ["<f"],
                    "tags": [{"begin": "<f>", "content": _json(OPEN), "end": "</f><"}],
                }
            ),
            "'additionalProperties' at /format/tags/0/content/json_schema",
        ),
        (
            _tag({"type": "sequence", "elements": [_json(OPEN), _json(AB)]}),
            "'additionalProperties' at /format/elements/0/json_schema",
        ),
        (
            GrammarSpec.lark('start: "x" %json ' + json.dumps(AB)),
            "'patternProperties' at %json 1 /",
        ),
        (
            GrammarSpec.lark("start: %json " + json.dumps({"type": "array", "items": OPEN})),
            "'additionalProperties' at %json 1 /items",
        ),
    ],
)
def test_values_the_tracker_cannot_follow_are_refused_strictly_and_reported_weakened(
    spec: GrammarSpec, where: str, toy_tokenizer: Any
) -> None:
    with pytest.raises(SchemaNotEnforceableError, match=where):
        compile_grammar(spec, toy_tokenizer)
    _, report = compile_grammar(spec, toy_tokenizer, allow_weakening=True)
    assert where in [i.describe().rsplit(" (", 1)[0] for i in report.weakened]


def test_closed_objects_inside_grammars_stay_exact(toy_tokenizer: Any) -> None:
    closed = {"type": "object", "properties": {"x": {"type": "integer"}},
              "additionalProperties": False}  # fmt: skip
    for spec in (
        GrammarSpec.lark('start: "x" %json ' + json.dumps(closed)),
        _tag({"type": "triggered_tags", "triggers": ["<f"],
              "tags": [{"begin": "<f>", "content": _json(closed), "end": "</f>"}]}),
    ):  # fmt: skip
        _, report = compile_grammar(spec, toy_tokenizer)
        assert report.weakened == ()


def test_a_triggered_tags_schema_is_analysed_like_any_other(toy_tokenizer: Any) -> None:
    """The tags of a tag list carry no ``type``: their schemas were not prepared at all (no
    keyword checks, no number policy)."""
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True,
              "maxItems": 9}  # fmt: skip
    spec = _tag({"type": "triggered_tags", "triggers": ["<f"],
                 "tags": [{"begin": "<f>", "content": _json(schema), "end": "</f>"}]})  # fmt: skip
    with pytest.raises(SchemaNotEnforceableError, match="'uniqueItems' at /format/tags/0/"):
        compile_grammar(spec, toy_tokenizer)


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (GrammarSpec.lark("start: %json " + json.dumps(AB)), '{"a": 1, "a": 2}'),
        (
            _tag({"type": "tag", "begin": "<" + "x" * MAX_FRAME_BYTES + ">",
                  "content": _json(AB), "end": "</x>"}),
            "<" + "x" * MAX_FRAME_BYTES + '>{"a": 1, "a": 2}</x>',
        ),
        (
            _tag({"type": "or", "elements": [_json(AB), {"type": "const_string", "value": "x"}]}),
            '{"b": 5, "b": 9}',
        ),
    ],
)  # fmt: skip
def test_a_weakened_value_is_not_called_valid(
    spec: GrammarSpec, text: str, toy_tokenizer: Any
) -> None:
    """Held-out sweep: with ``allow_weakening`` such grammars wrote repeats, and post-validation
    (a replay that accepts them) said ``valid``; now it says it did not check."""
    compiled, report = compile_grammar(spec, toy_tokenizer, allow_weakening=True)
    assert report.weakened
    verdict = postvalidate(compiled.spec, text, replay=replay_with(compiled, toy_tokenizer))
    assert not verdict.checked and not verdict.valid
    assert "repeat a key" in verdict.errors[0]
