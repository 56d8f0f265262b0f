"""Chat templates kept by GGUF tokenizer conversion: the file's own, else its architecture's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from espalier.constrained.chat_templates import GEMMA_CHAT_TEMPLATE, gguf_chat_template


def render(messages: list[dict[str, object]], add_generation_prompt: bool = True) -> str:
    # The environment transformers renders chat templates in (sandboxed, trimmed blocks).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = json.dumps
    template = env.from_string(GEMMA_CHAT_TEMPLATE)
    return template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<bos>"
    )


def test_gemma_turns_with_the_system_text_leading_the_first_user_turn() -> None:
    text = render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": "Hello"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\na\n\nb<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_tool_calls_and_results_render_as_turns() -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    text = render(
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "42"},
        ],
        add_generation_prompt=False,
    )
    assert '<start_of_turn>model\n[{"name": "f", "arguments": "{\\"x\\": 1}"}]<end_of_turn>' in text
    assert text.endswith("<start_of_turn>user\n42<end_of_turn>\n")


def write_gguf(path: Path, arch: str, template: str | None) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "own", "expected"),
    [
        ("llama", "{{ messages }}", "{{ messages }}"),  # the file's own template is kept
        ("gemma3", "{{ own }}", "{{ own }}"),
        ("gemma3", None, GEMMA_CHAT_TEMPLATE),  # none in the file: the architecture's
        ("llama", None, None),  # none known: none invented
    ],
)
def test_gguf_chat_template(
    tmp_path: Path, arch: str, own: str | None, expected: str | None
) -> None:
    assert gguf_chat_template(write_gguf(tmp_path / "m.gguf", arch, own)) == expected


def test_system_text_with_no_user_turn_after_it_is_a_turn_of_its_own() -> None:
    """A held-out sweep: a system message after the last user turn (or a conversation of
    system messages only) was dropped: its text led a user turn that never came."""
    trailing = render(
        [{"role": "user", "content": "hi"}, {"role": "system", "content": "Answer in French."}]
    )
    assert trailing.endswith(
        "<start_of_turn>user\nhi<end_of_turn>\n"
        "<start_of_turn>user\nAnswer in French.<end_of_turn>\n<start_of_turn>model\n"
    )
    alone = render([{"role": "system", "content": "Be brief."}])
    assert alone.endswith("<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n")
    leading = render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert leading.count("<start_of_turn>user") == 1 and "S\n\nU" in leading
