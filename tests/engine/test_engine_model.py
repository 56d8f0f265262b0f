"""Constrained generation with the real default model (Gemma 3 270M) on JSONSchemaBench schemas.

``test_all_outputs_parse_and_postvalidate`` (slow: all 20 schemas) asks every output to finish and
post-validate. Greedy Gemma 270M loops on several of them: it writes ``1000000...`` into an
unbounded integer (Github_trivial/o10021), repeats array items (``"name1", "name2", ...``) or a
sentence inside a string. Two policies make every output finish valid: bounded JSON numbers in
the grammar (``constrained/schema/number_bounds.py``) and closing within max_tokens
(``engine/closing/``). CI runs ``test_outputs_are_valid_or_honestly_reported`` on 3 of the
schemas: outputs that finish are valid, and an output cut by max_tokens is reported invalid by
post-validation, never as valid.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import FinishReason, GenerationRequest, SamplingParams
from espalier.server.default_model import default_gguf

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / ".data" / "jsonschemabench"
ARCHIVE = ROOT.parent / "shared" / "conformance" / "jsonschemabench.tar.xz"
# (subset, how many): the first files in name order that compile in strict mode and are small
PLAN = (
    ("Github_trivial", 4),
    ("Github_easy", 4),
    ("Glaiveai2K", 4),
    ("BFCL_simple", 3),
    ("Snowplow", 2),
    ("Kubernetes", 1),
    ("Handwritten", 2),
    ("Github_medium", 20),  # tops the list up to 20 when a subset above has too few
)
NUM_SCHEMAS = 20
MAX_SCHEMA_CHARS = 1500

pytestmark = pytest.mark.model


def ensure_data() -> Path:
    if not DATA.exists():
        if not ARCHIVE.exists():
            pytest.skip("JSONSchemaBench archive not available")
        (ROOT / ".data").mkdir(exist_ok=True)
        subprocess.run(["tar", "-xJf", str(ARCHIVE), "-C", str(ROOT / ".data")], check=True)
    return DATA


def select_schemas(tokenizer: object) -> list[tuple[str, dict]]:
    """The ``NUM_SCHEMAS`` schemas of the plan, as (name, schema)."""
    from espalier.constrained.compile import compile_grammar
    from espalier.constrained.errors import GrammarError

    data = ensure_data()
    chosen: list[tuple[str, dict]] = []
    for subset, count in PLAN:
        taken = 0
        for path in sorted((data / subset).glob("*.json")):
            if taken == count or len(chosen) == NUM_SCHEMAS:
                break
            schema = json.loads(path.read_text())["schema"]
            text = json.dumps(schema, separators=(",", ":"))
            if len(text) > MAX_SCHEMA_CHARS or schema.get("type") not in ("object", None):
                continue
            try:
                compile_grammar(GrammarSpec.json_schema(schema), tokenizer)  # type: ignore[arg-type]
            except GrammarError:
                continue  # not enforceable exactly (strict mode) or not supported
            chosen.append((f"{subset}/{path.stem}", schema))
            taken += 1
    return chosen


def prompt_for(schema: dict) -> str:
    text = json.dumps(schema, separators=(",", ":"))
    return f"JSON schema:\n{text}\nA short JSON object that is valid under this schema:\n"


def _generate(schemas_filter: bool) -> tuple[list[tuple[str, dict]], dict, dict[str, str], object]:
    from espalier.engine.engine import Engine, EngineConfig
    from espalier.engine.scheduler import SchedulerConfig

    engine = Engine.from_model(
        default_gguf(),
        EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=2048),
            compile_timeout_s=600.0,
        ),
    )
    schemas = select_schemas(engine.tokenizer)
    assert len(schemas) == NUM_SCHEMAS
    if schemas_filter:
        schemas = schemas[::7]  # 3 of them
    for name, schema in schemas:
        engine.add_request(
            GenerationRequest(
                name,
                prompt=prompt_for(schema),
                sampling=SamplingParams(max_tokens=256),
                grammar=GrammarSpec.json_schema(schema),
            )
        )
    texts: dict[str, str] = {}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
            if out.finished:
                finals[out.request_id] = out
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return schemas, finals, texts, engine


def test_outputs_are_valid_or_honestly_reported() -> None:
    import jsonschema

    schemas, finals, texts, _ = _generate(schemas_filter=True)
    for name, schema in schemas:
        final = finals[name]
        assert final.validation is not None and final.validation.checked, name
        if final.finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR):
            assert final.validation.valid, (name, final.validation, texts[name][:300])
            jsonschema.validate(json.loads(texts[name]), schema)
        else:
            cut = (FinishReason.LENGTH, FinishReason.LENGTH_UNCLOSED)
            assert final.finish_reason in cut, (name, final.finish_reason)
            try:
                really_valid = jsonschema.Draft202012Validator(schema).is_valid(
                    json.loads(texts[name])
                )
            except json.JSONDecodeError:
                really_valid = False
            assert final.validation.valid == really_valid, (name, texts[name][:300])


@pytest.mark.slow
def test_all_outputs_parse_and_postvalidate() -> None:
    schemas, finals, texts, _ = _generate(schemas_filter=False)
    failures = []
    for name, _schema in schemas:
        final = finals[name]
        ok = (
            final.finish_reason in (FinishReason.STOP, FinishReason.GRAMMAR)
            and final.validation is not None
            and final.validation.valid
        )
        if not ok:
            failures.append((name, final.finish_reason, final.validation, texts[name][:300]))
        else:
            json.loads(texts[name])
    assert not failures, failures
