"""Chat requests: messages rendered with the model's own chat template, a forced tool call as a
JSON-schema constraint, and the calls parsed back out of the output as typed fields.

``tool_choice``: "" / "none" force nothing; "required" constrains the output to a JSON array of
``{"name", "arguments"}`` objects, one schema branch per tool; a function's name constrains the
output to that function's arguments object. Either way the arguments validate against the tool's
parameters schema (the grammar enforces it, post-validation checks it again).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from espalier.constrained import json_text
from espalier.constrained.errors import InvalidGrammarError
from espalier.constrained.schema.guard import admit_schema
from espalier.constrained.spec import GrammarSpec
from espalier.server.errors import InvalidRequestError, Violation
from espalier.v1 import espalier_pb2 as pb

ROLES = frozenset({"system", "user", "assistant", "tool"})
MAX_MESSAGES = 256
MAX_TOOLS = 128
NO_CALL = ("", "none")
ANY_OBJECT: dict[str, Any] = {"type": "object"}

# (messages, tools or None) -> prompt token ids; raises InvalidRequestError
RenderChat = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]]


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request ready for the engine: prompt ids and the forced call's grammar (or None)."""

    token_ids: tuple[int, ...]
    grammar: GrammarSpec | None


def chat_bytes(chat: pb.Chat) -> int:
    """UTF-8 bytes of every caller text in ``chat`` (checked before anything parses it)."""
    total = sum(len(m.content.encode()) + len(m.role) for m in chat.messages)
    total += sum(len(c.arguments.encode()) for m in chat.messages for c in m.tool_calls)
    return total + sum(len(t.parameters.encode()) + len(t.description.encode()) for t in chat.tools)


def prepare_chat(chat: pb.Chat, render: RenderChat | None, bad: list[Violation]) -> ChatPrompt:
    """Validate ``chat`` (violations into ``bad``), render it and build the forced call's
    grammar; the prompt is empty when ``bad`` gained entries."""
    messages = _messages(chat, bad)
    schemas = _tool_schemas(chat, bad)
    grammar = _forced_call(chat, schemas, bad)
    if bad:
        return ChatPrompt((), None)
    if render is None:
        bad.append(Violation("chat", "this server has no tokenizer to render a chat with"))
        return ChatPrompt((), None)
    tools = [_template_tool(tool, schemas[tool.name]) for tool in chat.tools] or None
    return ChatPrompt(tuple(render(messages, tools)), grammar)


def _messages(chat: pb.Chat, bad: list[Violation]) -> list[dict[str, Any]]:
    if not chat.messages:
        bad.append(Violation("chat.messages", "must not be empty"))
    if len(chat.messages) > MAX_MESSAGES:
        bad.append(Violation("chat.messages", f"at most {MAX_MESSAGES} messages"))
    out = []
    for i, message in enumerate(chat.messages[:MAX_MESSAGES]):
        if message.role not in ROLES:
            roles = ", ".join(sorted(ROLES))
            bad.append(Violation(f"chat.messages[{i}].role", f"must be one of {roles}"))
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            turn["tool_calls"] = [
                {"id": c.id, "type": "function", "function": _call_function(c, i, bad)}
                for c in message.tool_calls
            ]
        if message.tool_call_id:
            turn["tool_call_id"] = message.tool_call_id
        out.append(turn)
    return out


def _call_function(call: pb.ToolCall, index: int, bad: list[Violation]) -> dict[str, Any]:
    try:
        arguments = json_text.loads(call.arguments or "{}")
    except json_text.JSONTextError as exc:
        bad.append(
            Violation(f"chat.messages[{index}].tool_calls", f"arguments must be JSON: {exc}")
        )
        arguments = {}
    return {"name": call.name, "arguments": arguments}


def _tool_schemas(chat: pb.Chat, bad: list[Violation]) -> dict[str, dict[str, Any]]:
    if len(chat.tools) > MAX_TOOLS:
        bad.append(Violation("chat.tools", f"at most {MAX_TOOLS} tools"))
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(chat.tools[:MAX_TOOLS]):
        where = f"chat.tools[{i}]"
        if not tool.name or not tool.name.replace("_", "").replace("-", "").isalnum():
            bad.append(Violation(f"{where}.name", "letters, digits, '_' and '-' only"))
        elif tool.name in schemas:
            bad.append(Violation(f"{where}.name", f"'{tool.name}' is named twice"))
        schema = ANY_OBJECT
        if tool.parameters:
            try:  # depth, meta-schema, local refs only: as a json_schema constraint
                admitted = admit_schema(tool.parameters)
            except InvalidGrammarError as exc:
                bad.append(Violation(f"{where}.parameters", exc.detail))
                continue
            if not isinstance(admitted, dict):
                bad.append(Violation(f"{where}.parameters", "must be a schema object"))
                continue
            arguments = _object_schema(admitted)
            if arguments is None:
                why = "must describe a JSON object (a call's arguments are one); its type does not"
                bad.append(Violation(f"{where}.parameters", why))
                continue
            schema = arguments
        schemas[tool.name] = schema
    return schemas


def _object_schema(schema: dict[str, Any]) -> dict[str, Any] | None:
    """``schema`` narrowed to JSON objects (a call's arguments are an object: ``{}`` or an
    untyped schema took ``"x"``), or None where its ``type`` excludes objects."""
    kind = schema.get("type")
    if kind == "object":
        return schema
    if kind is None or (isinstance(kind, list) and "object" in kind):
        return {**schema, "type": "object"}
    return None


def _forced_call(
    chat: pb.Chat, schemas: dict[str, dict[str, Any]], bad: list[Violation]
) -> GrammarSpec | None:
    choice = chat.tool_choice
    if choice in NO_CALL:
        return None
    if not chat.tools:
        bad.append(Violation("chat.tool_choice", "forces a call but no tools are given"))
        return None
    if choice != "required":
        if choice not in schemas:
            if all(tool.name != choice for tool in chat.tools):  # else: its own violation
                bad.append(Violation("chat.tool_choice", f"names no tool: '{choice}'"))
            return None
        return GrammarSpec.json_schema(schemas[choice])
    branches = []
    for i, (name, schema) in enumerate(schemas.items()):
        if "$ref" in json.dumps(schema):  # its refs point at its own root, not the array's
            why = "$ref is not supported with tool_choice 'required'; name the function"
            bad.append(Violation(f"chat.tools[{i}].parameters", why))
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return GrammarSpec.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": branches}})


def _template_tool(tool: pb.Tool, schema: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": schema}
    return {"type": "function", "function": function}


def forced_choice(request: pb.GenerateRequest) -> str:
    """The forced tool choice of a chat request ("" when none)."""
    if request.WhichOneof("prompt") != "chat" or request.chat.tool_choice in NO_CALL:
        return ""
    return request.chat.tool_choice


def parse_tool_calls(choice: str, text: str, request_id: str) -> list[pb.ToolCall]:
    """The calls in an output generated under ``choice``; [] when it is not complete JSON."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or an integer too long to convert
        return []
    if choice != "required":
        calls = [(choice, value)]
    elif isinstance(value, list):
        calls = [(c.get("name", ""), c.get("arguments")) for c in value if isinstance(c, dict)]
    else:
        return []
    return [
        pb.ToolCall(
            id=f"call_{request_id[:32]}_{i}",
            name=str(name),
            arguments=json.dumps(arguments, ensure_ascii=False, separators=(",", ":")),
        )
        for i, (name, arguments) in enumerate(calls)
    ]


def chat_error(exc: Exception) -> InvalidRequestError:
    """A template that failed to render the caller's messages, as a named violation."""
    detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    return InvalidRequestError(
        f"the chat template cannot render these messages: {detail}",
        violations=[Violation("chat.messages", detail)],
    )
