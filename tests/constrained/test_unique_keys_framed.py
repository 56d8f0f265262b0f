"""No key repeats in a structural tag's JSON value either (``keys.c``'s frame), and where the
tracker cannot follow a value (several of them, or one inside a Lark grammar), strict mode
refuses a schema whose objects may repeat a key instead of letting the repeat through.

The held-out sweep of session 50 got ``{"a": 172, "a": 0}`` out of a structural tag and a Lark
``%json`` block (``patternProperties: {"^[ab]$": ...}``, ``minProperties: 2``), marked valid.
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
from espalier.constrained.keys.native import MAX_FRAME, KeyTables, KeyTracker
from espalier.constrained.postvalidate import postvalidate, replay_with
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.structural_tag import after_reasoning, structural_tag_spec

AB = {
    "type": "object",
    "patternProperties": {"^[ab]$": {"type": "integer"}},
    "additionalProperties": False,
}
OPEN = {"type": "object", "properties": {"x": {"type": "integer"}}}


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


@pytest.mark.parametrize(("name", "spec", "frame", "good", "repeat"), FRAMED)
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
    tracker = KeyTracker(KeyTables(toy_tokenizer.token_bytes), None, b"</think>")
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
    with pytest.raises(ValueError, match="frame"):
        KeyTracker(KeyTables(toy_tokenizer.token_bytes), None, b"x" * (MAX_FRAME + 1))


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        (
            _tag(
                {
                    "type": "triggered_tags",
                    "triggers": ["<f"],
                    "tags": [{"begin": "<f>", "content": _json(OPEN), "end": "</f>"}],
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
            _tag({"type": "tag", "begin": "<" + "x" * MAX_FRAME + ">", "content": _json(AB),
                  "end": "</x>"}),
            "<" + "x" * MAX_FRAME + '>{"a": 1, "a": 2}</x>',
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
