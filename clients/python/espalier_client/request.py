"""Building request messages from keyword arguments, shared by Client and AsyncClient."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from espalier_client._proto import espalier_pb2 as pb

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]
"""Text, token ids, or chat messages."""


def schema_of(schema_or_model: Any) -> tuple[dict[str, Any] | bool, Any]:
    """(JSON schema, pydantic model or None) from a schema dict/JSON text or a pydantic model."""
    if isinstance(schema_or_model, type) and hasattr(schema_or_model, "model_json_schema"):
        return schema_or_model.model_json_schema(), schema_or_model
    if isinstance(schema_or_model, str):
        return json.loads(schema_or_model), None
    if isinstance(schema_or_model, (dict, bool)):
        return schema_or_model, None
    raise TypeError("expected a JSON schema (dict or JSON text) or a pydantic model class")


def build_constraint(
    *,
    schema: Any = None,
    any_json: bool = False,
    regex: str | None = None,
    ebnf: str | None = None,
    lark: str | None = None,
    choice: Sequence[str] | None = None,
    structural_tag: dict[str, Any] | str | None = None,
    after_reasoning: bool = False,
    backend: str = "",
    allow_weakening: bool = False,
) -> pb.Constraint | None:
    """At most one kind; None when none is given.

    ``structural_tag``: xgrammar's structural-tag format (object or JSON text).
    ``after_reasoning``: the constraint starts after the model's reasoning end marker.
    """
    given = [
        k
        for k, v in (
            ("schema", schema),
            ("any_json", any_json or None),
            ("regex", regex),
            ("ebnf", ebnf),
            ("lark", lark),
            ("choice", choice),
            ("structural_tag", structural_tag),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError(f"give at most one constraint, got {', '.join(given)}")
    if not given:
        if after_reasoning:
            raise ValueError("after_reasoning applies to a constraint; give one")
        return None
    c = pb.Constraint(
        backend=backend, allow_weakening=allow_weakening, after_reasoning=after_reasoning
    )
    if isinstance(schema, str):
        c.json_schema = schema  # as given: the server reports where malformed text fails
    elif schema is not None:
        c.json_schema = json.dumps(schema_of(schema)[0])
    elif any_json:
        c.any_json.SetInParent()
    elif regex is not None:
        c.regex = regex
    elif ebnf is not None:
        c.ebnf = ebnf
    elif lark is not None:
        c.lark = lark
    elif choice is not None:
        c.choice.options.extend(choice)
    elif structural_tag is not None:
        as_text = isinstance(structural_tag, str)
        c.structural_tag = structural_tag if as_text else json.dumps(structural_tag)
    return c


def build_chat(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    tool_choice: str = "",
) -> pb.Chat:
    """A Chat from OpenAI-style messages and tools (``{"type": "function", "function": {...}}``
    or the bare function object); ``tool_choice``: "", "none", "required" or a function name."""
    chat = pb.Chat(tool_choice=tool_choice)
    for message in messages:
        turn = chat.messages.add(
            role=message["role"],
            content=message.get("content") or "",
            tool_call_id=message.get("tool_call_id", ""),
        )
        for call in message.get("tool_calls") or ():
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            turn.tool_calls.add(
                id=call.get("id", ""),
                name=function["name"],
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters")
        chat.tools.add(
            name=function["name"],
            description=function.get("description", ""),
            parameters=json.dumps(parameters) if parameters is not None else "",
        )
    return chat


def build_generate_request(
    prompt: Prompt,
    *,
    request_id: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: int = 0,
    speculative: bool | None = None,
    speculative_methods: Sequence[str] = (),
    num_draft_tokens: int | None = None,
    tools: Sequence[dict[str, Any]] = (),
    tool_choice: str = "",
    **constraint: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest; ``constraint`` takes the keywords of :func:`build_constraint`.

    ``prompt``: text, token ids, or chat messages (dicts with ``role`` and ``content``),
    rendered by the server with the model's chat template; ``tools`` / ``tool_choice`` go
    with messages (see :func:`build_chat`).
    """
    msg = pb.GenerateRequest(request_id=request_id)
    if isinstance(prompt, str):
        msg.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        msg.chat.CopyFrom(build_chat(list(prompt), tools, tool_choice))  # type: ignore[arg-type]
    else:
        msg.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    if (tools or tool_choice) and not msg.HasField("chat"):
        raise ValueError("tools and tool_choice go with chat messages")
    s = msg.sampling
    s.top_k = top_k
    s.stop.extend(stop)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    s.logprobs = logprobs
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("min_p", min_p),
        ("seed", seed),
    ):
        if value is not None:
            setattr(s, name, value)
    if speculative is not None:
        msg.speculative.enabled = speculative
    msg.speculative.methods.extend(speculative_methods)
    if num_draft_tokens is not None:
        msg.speculative.num_draft_tokens = num_draft_tokens
    built = build_constraint(**constraint)
    if built is not None:
        msg.constraint.CopyFrom(built)
    return msg


def parse_json_output(text: str, schema: Any, model: Any) -> Any:
    """Parse and validate generated JSON: a pydantic instance for a model, else the value."""
    from espalier_client.errors import OutputValidationError

    if model is not None:
        try:
            return model.model_validate_json(text)
        except Exception as exc:  # pydantic.ValidationError, without importing pydantic here
            raise OutputValidationError(f"output does not validate: {exc}", text) from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OutputValidationError(f"output is not JSON: {exc}", text) from exc
    try:
        import jsonschema
    except ImportError:  # the server post-validated it; jsonschema is an optional extra
        return value
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        raise OutputValidationError(f"output does not validate: {exc.message}", text) from exc
    return value
