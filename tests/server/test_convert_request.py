"""Proto → engine request conversion: every invalid field becomes a named violation."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from espalier.constrained.errors import InvalidGrammarError, KeywordIssue
from espalier.constrained.spec import GrammarKind
from espalier.engine.api import (
    FinishReason,
    RequestOutput,
    SpeculativeStats,
    Timings,
    Usage,
    ValidationResult,
)
from espalier.server import convert
from espalier.server.errors import InvalidRequestError, PromptTooLongError
from espalier.v1 import espalier_pb2 as pb

LIMITS = convert.RequestLimits(
    vocab_size=1000,
    max_prompt_tokens=8,
    max_grammar_bytes=64,
    default_max_tokens=16,
    max_max_tokens=100,
    max_prompt_bytes=32,
    max_stop_bytes=8,
    max_choices=4,
    max_grammar_alternatives=3,
    speculative_methods=frozenset({"ngram", "forced"}),
)
WIDE = dataclasses.replace(LIMITS, max_grammar_bytes=4096)


def count_chars(text: str) -> int:
    return len(text)


def fields_of(exc: InvalidRequestError) -> list[str]:
    return [v.field for v in exc.violations]


def test_a_valid_request_converts_with_defaults() -> None:
    msg = pb.GenerateRequest(text="hi", constraint=pb.Constraint(regex="[a-z]+"))
    req = convert.request_from_proto(msg, LIMITS, count_chars)
    assert req.prompt == "hi" and req.prompt_token_ids is None
    assert req.request_id  # assigned
    assert req.sampling.max_tokens == 16 and req.sampling.top_p == 1.0
    assert req.sampling.temperature == 0.0 and req.sampling.seed is None
    assert req.grammar is not None and req.grammar.kind is GrammarKind.REGEX
    assert req.constraint.backend == "auto" and not req.constraint.allow_weakening
    assert req.speculative.enabled is None


def test_every_constraint_kind_converts() -> None:
    kinds = {
        "json_schema": pb.Constraint(json_schema='{"type":"integer"}'),
        "any_json": pb.Constraint(any_json=pb.AnyJson()),
        "regex": pb.Constraint(regex="a|b"),
        "ebnf": pb.Constraint(ebnf='root ::= "x"'),
        "lark": pb.Constraint(lark='start: "x"'),
        "choice": pb.Constraint(choice=pb.Choice(options=["yes", "no"])),
    }
    for kind, constraint in kinds.items():
        spec, _ = convert.constraint_to_spec(constraint, WIDE)
        assert spec is not None and spec.kind.value == kind
    spec, options = convert.constraint_to_spec(pb.Constraint(backend="auto"), WIDE)
    assert spec is None and options.backend == "auto"


def test_a_backend_without_a_constraint_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        convert.constraint_to_spec(pb.Constraint(backend="xgrammar"), WIDE)
    assert fields_of(info.value) == ["constraint.backend"]


def test_the_documented_backend_name_outlines_is_outlines_core() -> None:
    _, options = convert.constraint_to_spec(pb.Constraint(regex="a", backend="outlines"), WIDE)
    assert options.backend == "outlines_core"


def test_all_bad_fields_are_reported_together() -> None:
    msg = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1, 2, 5000]),
        sampling=pb.SamplingParams(
            temperature=-1.0,
            top_p=0.0,
            top_k=-3,
            max_tokens=1000,
            logprobs=50,
            stop=[""],
            stop_token_ids=[99999],
        ),
        speculative=pb.SpeculativeOptions(methods=["ngram", "magic", "eagle"], num_draft_tokens=0),
    )
    with pytest.raises(InvalidRequestError) as info:
        convert.request_from_proto(msg, LIMITS, count_chars)
    assert fields_of(info.value) == [
        "sampling.temperature",
        "sampling.top_k",
        "sampling.top_p",
        "sampling.logprobs",
        "sampling.max_tokens",
        "sampling.stop[0]",
        "sampling.stop_token_ids[0]",
        "speculative.methods[1]",
        "speculative.methods[2]",
        "speculative.num_draft_tokens",
        "token_ids.ids[2]",
    ]


def test_missing_prompt_and_bad_request_id() -> None:
    with pytest.raises(InvalidRequestError) as info:
        convert.request_from_proto(pb.GenerateRequest(request_id="x\n"), LIMITS, count_chars)
    assert fields_of(info.value) == ["request_id", "prompt"]


def test_prompt_over_the_token_limit() -> None:
    with pytest.raises(PromptTooLongError) as info:
        convert.request_from_proto(pb.GenerateRequest(text="x" * 9), LIMITS, count_chars)
    assert fields_of(info.value) == ["text"] and info.value.reason == "PROMPT_TOO_LONG"
    ids = pb.TokenIds(ids=list(range(9)))
    with pytest.raises(PromptTooLongError):
        convert.request_from_proto(pb.GenerateRequest(token_ids=ids), LIMITS, count_chars)


def test_grammar_over_the_byte_limit() -> None:
    msg = pb.GenerateRequest(text="x", constraint=pb.Constraint(regex="a" * 65))
    with pytest.raises(InvalidRequestError) as info:
        convert.request_from_proto(msg, LIMITS, count_chars)
    assert fields_of(info.value) == ["constraint.regex"]
    assert info.value.violations[0].reason == "TOO_LARGE"
    choice = pb.Constraint(choice=pb.Choice(options=["y" * 40, "n" * 40]))
    with pytest.raises(InvalidRequestError) as info:
        convert.constraint_to_spec(choice, LIMITS)
    assert fields_of(info.value) == ["constraint.choice.options"]


def test_size_limits_hold_before_any_parsing() -> None:
    """Prompt bytes (not tokenized), stop bytes, choice count, grammar alternatives."""

    def never(text: str) -> int:
        raise AssertionError("tokenized a prompt over the byte limit")

    with pytest.raises(PromptTooLongError) as info:
        convert.request_from_proto(pb.GenerateRequest(text="é" * 17), LIMITS, never)
    assert info.value.metadata["limit_bytes"] == "32"
    msg = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["ok", "s" * 9]))
    with pytest.raises(InvalidRequestError) as info:
        convert.request_from_proto(msg, LIMITS, count_chars)
    assert fields_of(info.value) == ["sampling.stop[1]"]
    five = pb.Constraint(choice=pb.Choice(options=list("abcde")))
    with pytest.raises(InvalidRequestError) as info:
        convert.constraint_to_spec(five, LIMITS)
    assert info.value.metadata == {"limit_options": "4", "size_options": "5"}
    lark = 'start: "a" | "b" | "c" | /x|y/ | "d|e"'  # 4 alternatives: '|' in literals do not count
    with pytest.raises(InvalidGrammarError, match="4 alternatives"):
        convert.constraint_to_spec(pb.Constraint(lark=lark), WIDE)
    convert.constraint_to_spec(pb.Constraint(lark=lark.replace(' | "c"', "")), WIDE)


def test_non_finite_sampling_parameters_are_refused() -> None:
    inf, nan = float("inf"), float("nan")
    sampling = pb.SamplingParams(temperature=inf, top_p=nan, min_p=-inf)
    with pytest.raises(InvalidRequestError) as info:
        convert.request_from_proto(pb.GenerateRequest(text="x", sampling=sampling), LIMITS)
    assert fields_of(info.value) == ["sampling.temperature", "sampling.top_p", "sampling.min_p"]
    assert all(v.description == "must be a finite number" for v in info.value.violations)


def test_a_schema_is_checked_against_its_metaschema_with_a_pointer() -> None:
    schema = pb.Constraint(json_schema='{"properties": {"a": {"minLength": -1}}}')
    with pytest.raises(InvalidGrammarError) as info:
        convert.constraint_to_spec(schema, WIDE)
    assert info.value.pointer == "/properties/a/minLength"
    deep = pb.Constraint(json_schema="[" * 3000)
    with pytest.raises(InvalidGrammarError, match="nested 3000 levels"):
        convert.constraint_to_spec(deep, dataclasses.replace(WIDE, max_grammar_bytes=1 << 20))


def test_malformed_schema_raises_the_grammar_error_with_its_location() -> None:
    msg = pb.GenerateRequest(text="x", constraint=pb.Constraint(json_schema='{"type": }'))
    with pytest.raises(InvalidGrammarError) as info:
        convert.request_from_proto(msg, LIMITS, count_chars)
    assert info.value.line == 1 and info.value.column == 10


def test_output_chunks_fold_into_the_unary_response() -> None:
    chunks = [
        convert.output_to_proto(RequestOutput("r", '{"a"', (5, 6))),
        convert.output_to_proto(
            RequestOutput(
                "r",
                ": 1}",
                (7,),
                finished=True,
                finish_reason=FinishReason.GRAMMAR,
                usage=Usage(3, 3, 0),
                timings=Timings(total_s=0.5),
                speculative=SpeculativeStats(steps=2, accepted_tokens=3),
                validation=ValidationResult(True, True),
                backend="xgrammar",
                weakened=(KeywordIssue("pattern", "/properties/a", "ignored", "xgrammar"),),
            )
        ),
    ]
    assert not chunks[0].finished and not chunks[0].HasField("usage")
    merged = convert.merge_unary(chunks)
    assert json.loads(merged.text) == {"a": 1}
    assert list(merged.token_ids) == [5, 6, 7]
    assert merged.finish_reason == pb.FINISH_REASON_GRAMMAR
    assert merged.usage.completion_tokens == 3 and merged.timings.total_seconds == 0.5
    assert merged.speculative.mean_accept_length == 1.5
    assert merged.validation.checked and merged.validation.valid
    assert merged.backend == "xgrammar"
    issue = merged.weakened[0]  # each field its own (the keyword held the whole sentence)
    assert (issue.keyword, issue.pointer, issue.support, issue.backend) == (
        "pattern",
        "/properties/a",
        "ignored",
        "xgrammar",
    )


def test_structural_tag_is_admitted_like_a_schema() -> None:
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}],
        "triggers": ["<f"],
    }
    spec, _ = convert.constraint_to_spec(pb.Constraint(structural_tag=json.dumps(tag)), WIDE)
    assert spec is not None and spec.kind is GrammarKind.STRUCTURAL_TAG
    assert '"triggered_tags"' in spec.source
    deep = '{"type": "structural_tag", "format": ' + "[" * 300 + "]" * 300 + "}"
    bad_schema = json.dumps(
        {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": 5}}}
    )
    outside = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {}}}
    outside["format"]["json_schema"] = {"$ref": "https://example.com/s.json"}
    for text in ("{", deep, bad_schema, json.dumps(outside), '{"type": "structural_tag"}'):
        with pytest.raises(InvalidGrammarError):
            convert.constraint_to_spec(pb.Constraint(structural_tag=text), WIDE)
    with pytest.raises(InvalidRequestError):  # over max_grammar_bytes, before any parsing
        convert.constraint_to_spec(pb.Constraint(structural_tag=json.dumps(tag)), LIMITS)


def test_after_reasoning_wraps_the_constraint_or_is_refused() -> None:
    thinking = dataclasses.replace(WIDE, reasoning_end="</think>")
    msg = pb.Constraint(regex="[a-z]+", after_reasoning=True)
    spec, _ = convert.constraint_to_spec(msg, thinking)
    assert spec is not None and spec.kind is GrammarKind.STRUCTURAL_TAG
    assert "</think>" in spec.source and "[a-z]+" in spec.source
    for constraint, limits in [(msg, WIDE), (pb.Constraint(after_reasoning=True), thinking)]:
        with pytest.raises(InvalidRequestError) as info:
            convert.constraint_to_spec(constraint, limits)
        assert fields_of(info.value) == ["constraint.after_reasoning"]


def test_an_unclosed_cut_keeps_its_own_finish_reason_up_to_the_sdk() -> None:
    from espalier_client._proto import espalier_pb2 as client_pb
    from espalier_client.types import Generation

    out = RequestOutput(
        "r",
        '{"a": [',
        (5, 6),
        finished=True,
        finish_reason=FinishReason.LENGTH_UNCLOSED,
        usage=Usage(3, 2, 0),
        validation=ValidationResult(True, False, ("not valid JSON",)),
    )
    merged = convert.merge_unary([convert.output_to_proto(out)])
    assert merged.finish_reason == pb.FINISH_REASON_LENGTH_UNCLOSED
    wire = merged.SerializeToString()
    result = Generation.from_proto(client_pb.GenerateResponse.FromString(wire))
    assert result.finish_reason == "length_unclosed" and result.valid is False


def test_a_negative_seed_is_taken_and_seeds_like_any_other() -> None:
    """A held-out sweep through SMG: OpenAI and vLLM take negative seeds (SMG forwards int32
    ones), espalier answered 400 ``sampling.seed: must be >= 0``. Any int64 seeds a
    generator: the same seed draws the same numbers, another seed others."""
    from espalier.engine.sampler import make_generator

    for seed in (-1, -(2**63), 2**63 - 1):
        msg = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(seed=seed))
        assert convert.request_from_proto(msg, LIMITS, count_chars).sampling.seed == seed
    draws = {
        seed: tuple(torch.rand(4, generator=make_generator(seed)).tolist()) for seed in (-1, -2, 7)
    }
    assert draws[-1] == tuple(torch.rand(4, generator=make_generator(-1)).tolist())
    assert len(set(draws.values())) == 3
