"""Chat templates for tokenizers converted from GGUF files.

A GGUF file carries its model's template in ``tokenizer.chat_template``; the conversion keeps it.
Some files omit it (the embedded Gemma 3 270M does): for those the template of the file's
``general.architecture`` is used, written here from the model family's documented turn format,
so that a chat request renders the way the model was trained to read it.

Templates are Jinja as transformers' ``apply_chat_template`` and SMG's minijinja render them:
``messages`` (``role``, ``content`` as a string or a list of ``{"type": "text"}`` parts),
``add_generation_prompt``, ``bos_token``.
"""

from __future__ import annotations

from pathlib import Path

# Gemma's turns: <start_of_turn>user|model\n ... <end_of_turn>\n. No system role: the system
# text leads the next user turn, or is one of its own where no user turn follows (a held-out
# sweep: a system message after the last user turn was dropped). Tool results come back as user
# turns, tool calls as the model's own JSON text.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- elif message['content'] -%}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n\\n') -%}"
    "{%- else -%}{%- set content = '' -%}{%- endif -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- set content = content + (message['tool_calls'] | map(attribute='function')"
    " | list | tojson) -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + content + '\\n\\n' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<start_of_turn>model\\n' + content | trim + '<end_of_turn>\\n' }}"
    "{%- else -%}"
    "{{ '<start_of_turn>user\\n' + ns.system + content | trim + '<end_of_turn>\\n' }}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.system -%}"
    "{{ '<start_of_turn>user\\n' + ns.system | trim + '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

TEMPLATES_BY_ARCHITECTURE = {
    "gemma": GEMMA_CHAT_TEMPLATE,
    "gemma2": GEMMA_CHAT_TEMPLATE,
    "gemma3": GEMMA_CHAT_TEMPLATE,
}


def gguf_chat_template(gguf_path: str | Path) -> str | None:
    """The file's own ``tokenizer.chat_template``, else its architecture's, else None."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    own = fields.get("tokenizer.chat_template")
    if own is not None:
        text = own.contents()
        if isinstance(text, str) and text.strip():
            return text
    arch = fields.get("general.architecture")
    return TEMPLATES_BY_ARCHITECTURE.get(str(arch.contents())) if arch is not None else None
