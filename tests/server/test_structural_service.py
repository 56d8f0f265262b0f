"""Structural tags and reasoning through ``espalier serve`` with the Python SDK (tiny random
model, Gemma tokenizer): exact inside tags, speculative == plain, the reasoning switch, and
errors naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest
from espalier_client import Client, InvalidArgumentError

from tests.fixtures.server_helpers import REGEX, SCHEMA
from tests.fixtures.server_process import ServerProcess

pytestmark = pytest.mark.model

# SCHEMA with the name's maxLength spelled as a pattern: xgrammar does not enforce a length
# bound exactly (it writes raw control characters there), and both backends are checked here
NAMED = {"type": "string", "pattern": "^[a-z]{1,5}$"}
TAG_SCHEMA = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": NAMED}}
TAGGED = {
    "type": "structural_tag",
    "format": {
        "type": "sequence",
        "elements": [
            {
                "type": "tag",
                "begin": "<r>",
                "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
                "end": "</r>",
            },
            {"type": "const_string", "value": "."},
        ],
    },
}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.address, timeout_s=600.0) as c:
        yield c


def test_model_info_reports_the_reasoning_marker(client: Client) -> None:
    assert client.model_info().reasoning_end == "</think>"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_structural_tag_is_exact_and_speculation_lossless(
    serving: ServerProcess, client: Client, backend: str
) -> None:
    kwargs = dict(structural_tag=TAGGED, backend=backend, max_tokens=96)
    plain = client.generate("Tagged: ", **kwargs)
    assert plain.backend == backend and plain.finish_reason in ("stop", "grammar")
    match = re.fullmatch(r"<r>(.*)</r>\.", plain.text, re.DOTALL)
    assert match, plain.text
    jsonschema.validate(json.loads(match.group(1)), TAG_SCHEMA)
    fast = client.generate(
        "Tagged: ", speculative=True, speculative_methods=["ngram", "forced"], **kwargs
    )
    assert fast.token_ids == plain.token_ids
    assert fast.raw.speculative.forced_tokens > 0  # "<r>", keys and "</r>" are forced


def test_after_reasoning_is_free_then_exact(serving: ServerProcess, client: Client) -> None:
    kwargs = dict(regex=REGEX, after_reasoning=True, max_tokens=40, temperature=1.0)
    for seed in range(3):
        result = client.generate("Think: ", seed=seed, **kwargs)
        chunks = list(client.stream("Think: ", seed=seed, **kwargs))
        assert "".join(c.text for c in chunks) == result.text
        _thought, marker, answer = result.text.partition("</think>")
        if marker:  # the model closed its thought: exactly the constraint after it
            assert re.fullmatch(REGEX, answer), result.text
        else:  # still thinking when the budget ran out: the grammar cannot end there
            assert result.finish_reason == "length_unclosed", result.text


def test_bad_structural_tags_name_the_field(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.generate("x", structural_tag={"type": "structural_tag", "format": {"type": "x"}})
    assert info.value.field_violations[0].field.startswith("constraint.structural_tag")
    with pytest.raises(InvalidArgumentError) as info:
        client.generate("x", structural_tag=TAGGED, backend="outlines")
    assert "structural_tag" in str(info.value)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"name": "time", "parameters": {"type": "object", "properties": {}, "maxProperties": 0}},
]
MESSAGES = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "Weather in Oslo for 2 days?"},
]


@pytest.mark.parametrize("tool_choice", ["weather", "required"])
def test_chat_tool_calls_are_typed_and_validate(
    serving: ServerProcess, client: Client, tool_choice: str
) -> None:
    # the random model writes whitespace where it may: a list of calls needs room
    budget = 128 if tool_choice != "required" else 1024
    kwargs = dict(tools=TOOLS, tool_choice=tool_choice, backend="llguidance", max_tokens=budget)
    result = client.generate(MESSAGES, **kwargs)
    assert result.finish_reason in ("stop", "grammar") and result.valid is True, result.text
    assert result.tool_calls and result.prompt_tokens > 20  # the template's turns and markers
    schemas = {"weather": WEATHER, "time": TOOLS[1]["parameters"]}
    for call in result.tool_calls:
        jsonschema.validate(call.arguments, schemas[call.name])
    if tool_choice == "weather":
        assert [c.name for c in result.tool_calls] == ["weather"]
        assert result.tool_calls[0].arguments == json.loads(result.text)
    chunks = list(client.stream(MESSAGES, **kwargs))
    assert "".join(c.text for c in chunks) == result.text
    assert not any(c.raw.tool_calls for c in chunks[:-1])
    streamed = [(c.name, c.arguments) for c in chunks[-1].raw.tool_calls]
    assert streamed == [(c.name, c.arguments) for c in result.raw.tool_calls]


def test_chat_errors_name_the_field(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.generate(MESSAGES, tools=TOOLS, tool_choice="nope")
    assert info.value.field_violations[0].field == "chat.tool_choice"
    with pytest.raises(InvalidArgumentError) as info:
        client.generate(MESSAGES, tools=TOOLS, tool_choice="weather", regex="a+")
    assert info.value.field_violations[0].field == "chat.tool_choice"


def test_stream_json_yields_growing_values_then_the_whole(
    serving: ServerProcess, client: Client
) -> None:
    values = list(client.stream_json(SCHEMA, "A pet: ", backend="llguidance", max_tokens=128))
    final = client.generate_json(SCHEMA, "A pet: ", backend="llguidance", max_tokens=128)
    assert len(values) > 2 and values[-1] == final
    assert all(isinstance(v, dict) for v in values)
    assert set(values[-2]) <= set(final)
