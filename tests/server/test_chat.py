"""Chat requests in the server's conversion layer: validation by field, the forced call's
grammar, and tool calls parsed from outputs. The template rendering is a recording stand-in
here; tests/server/test_structural_service.py renders with the model's own template."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from espalier.constrained.spec import GrammarKind
from espalier.server.chat import forced_choice, parse_tool_calls, prepare_chat
from espalier.server.errors import Violation
from espalier.v1 import espalier_pb2 as pb

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}


def chat(tool_choice: str = "", tools: tuple[pb.Tool, ...] = ()) -> pb.Chat:
    """One user turn, tools ``weather`` and ``time`` plus ``tools``."""
    return pb.Chat(
        messages=[pb.ChatMessage(role="user", content="Weather in Oslo?")],
        tools=[
            pb.Tool(name="weather", description="forecast", parameters=json.dumps(WEATHER)),
            pb.Tool(name="time"),
            *tools,
        ],
        tool_choice=tool_choice,
    )


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    render.seen = (messages, tools)  # type: ignore[attr-defined]
    return [1, 2, 3]


def test_messages_and_tools_reach_the_template_in_openai_form() -> None:
    bad: list[Violation] = []
    prepared = prepare_chat(chat(), render, bad)
    assert bad == [] and prepared.token_ids == (1, 2, 3) and prepared.grammar is None
    messages, tools = render.seen  # type: ignore[attr-defined]
    assert messages == [{"role": "user", "content": "Weather in Oslo?"}]
    assert tools[0]["function"]["parameters"] == WEATHER
    assert tools[1]["function"]["parameters"] == {"type": "object"}


def test_a_named_function_constrains_to_its_arguments() -> None:
    prepared = prepare_chat(chat("weather"), render, [])
    assert prepared.grammar is not None and prepared.grammar.kind is GrammarKind.JSON_SCHEMA
    assert prepared.grammar.schema == WEATHER


def test_required_constrains_to_a_list_of_calls() -> None:
    prepared = prepare_chat(chat("required"), render, [])
    assert prepared.grammar is not None
    schema = prepared.grammar.schema
    good = [{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "time", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad_value in ([], [{"name": "weather", "arguments": {"days": 2}}], [{"name": "x"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad_value, schema)


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (pb.Chat(), "chat.messages"),
        (pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")]), "chat.messages[0].role"),
        (chat("nope"), "chat.tool_choice"),
        (
            pb.Chat(messages=[pb.ChatMessage(role="user")], tool_choice="required"),
            "chat.tool_choice",
        ),
        (chat(tools=(pb.Tool(name="weather"),)), "chat.tools[2].name"),
        (chat(tools=(pb.Tool(name="a b"),)), "chat.tools[2].name"),
        (chat(tools=(pb.Tool(name="x", parameters="{"),)), "chat.tools[2].parameters"),
        (chat(tools=(pb.Tool(name="x", parameters='{"type": 5}'),)), "chat.tools[2].parameters"),
        (
            chat(
                "required",
                tools=(pb.Tool(name="r", parameters='{"$defs": {"a": {}}, "$ref": "#/$defs/a"}'),),
            ),
            "chat.tools[2].parameters",
        ),
    ],
)
def test_bad_chats_name_the_field(msg: pb.Chat, field: str) -> None:
    bad: list[Violation] = []
    prepare_chat(msg, render, bad)
    assert field in [v.field for v in bad]


@pytest.mark.parametrize(
    ("parameters", "schema"),
    [
        ("{}", {"type": "object"}),
        ('{"properties": {"a": {}}}', {"properties": {"a": {}}, "type": "object"}),
        ('{"type": ["string", "object"]}', {"type": "object"}),
        ('{"type": "string"}', None),
        ('{"type": ["integer", "null"]}', None),
    ],
)
def test_a_tools_arguments_are_an_object(parameters: str, schema: dict[str, Any] | None) -> None:
    """A call's arguments are a JSON object: ``{}`` or an untyped schema took ``"x"`` (an
    output the caller cannot read as arguments); a type without objects is a violation."""
    bad: list[Violation] = []
    prepared = prepare_chat(
        chat("x", tools=(pb.Tool(name="x", parameters=parameters),)), render, bad
    )
    if schema is None:
        assert [v.field for v in bad] == ["chat.tools[2].parameters"]
        return
    assert bad == [] and prepared.grammar is not None
    assert prepared.grammar.schema == schema


def test_a_forced_tool_with_bad_parameters_gets_one_violation_not_two() -> None:
    """The tool exists: 'names no tool' would send the caller looking for the wrong mistake."""
    bad: list[Violation] = []
    prepare_chat(chat("x", tools=(pb.Tool(name="x", parameters="{"),)), render, bad)
    assert [v.field for v in bad] == ["chat.tools[2].parameters"]


def test_tool_call_arguments_past_the_int_digit_limit_are_a_violation() -> None:
    turn = pb.ChatMessage(
        role="assistant",
        tool_calls=[pb.ToolCall(id="1", name="time", arguments='{"a": 1' + "0" * 5000 + "}")],
    )
    msg = chat()
    msg.messages.append(turn)
    bad: list[Violation] = []
    prepare_chat(msg, render, bad)
    assert [v.field for v in bad] == ["chat.messages[1].tool_calls"]
    assert "4300 digits" in bad[0].description


def test_an_output_python_cannot_read_as_json_has_no_calls() -> None:
    """The model's output, not the caller's: a 5,000-digit integer is no call, not an error."""
    assert parse_tool_calls("time", '{"a": 1' + "0" * 5000 + "}", "r1") == []


def test_tool_calls_are_parsed_from_the_output() -> None:
    [call] = parse_tool_calls("weather", '{"city": "Oslo"}', "r1")
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "Oslo"}
    calls = parse_tool_calls(
        "required", '[{"name": "time", "arguments": {}}, {"name": "weather", "arguments": {}}]', "r"
    )
    assert [c.name for c in calls] == ["time", "weather"] and calls[0].id != calls[1].id
    assert parse_tool_calls("weather", '{"city": "Os', "r") == []  # cut short: no call
    request = pb.GenerateRequest(chat=chat("required"))
    assert forced_choice(request) == "required"
    assert forced_choice(pb.GenerateRequest(text="x")) == ""
