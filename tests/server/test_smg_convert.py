"""SMG worker messages ↔ espalier's: field by field, without a server."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vpb

from espalier.server.errors import InvalidRequestError
from espalier.server.smg import convert
from espalier.v1 import espalier_pb2 as pb


def request(**params: Any) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id="r1",
        tokenized=vpb.TokenizedInput(input_ids=[2, 5, 7]),
        sampling_params=vpb.SamplingParams(**params),
    )


@pytest.mark.parametrize(
    ("params", "kind", "value"),
    [
        ({"json_schema": '{"type": "object"}'}, "json_schema", '{"type": "object"}'),
        ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"grammar": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
        ({"grammar": 'start: "a"'}, "lark", 'start: "a"'),
        ({"json_object": True}, "any_json", pb.AnyJson()),
        ({"choice": vpb.ChoiceConstraint(choices=["x", "y"])}, "choice", None),
        ({}, None, None),
    ],
)
def test_each_constraint_kind_maps_to_ours(
    params: dict[str, Any], kind: str | None, value: Any
) -> None:
    ours = convert.to_espalier_request(request(**params))
    assert ours.constraint.WhichOneof("kind") == kind
    if kind == "choice":
        assert list(ours.constraint.choice.options) == ["x", "y"]
    elif kind is not None:
        assert getattr(ours.constraint, kind) == value


def test_sampling_defaults_follow_vllm() -> None:
    ours = convert.to_espalier_request(request())
    assert ours.sampling.temperature == 1.0  # unset: vLLM's default, not greedy
    assert ours.sampling.top_p == 1.0  # proto3 0 means unset
    assert not ours.sampling.HasField("max_tokens")  # the server's default applies
    assert list(ours.token_ids.ids) == [2, 5, 7] and ours.request_id == "r1"
    explicit = convert.to_espalier_request(
        request(temperature=0.0, top_p=0.5, top_k=4, max_tokens=9, seed=3, stop=["\n"])
    )
    s = explicit.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed) == (0.0, 0.5, 4, 9, 3)
    assert list(s.stop) == ["\n"]


def test_uint32_counts_past_our_int32_are_clamped_not_an_internal_error() -> None:
    ours = convert.to_espalier_request(request(top_k=2**32 - 1, max_tokens=2**31))
    assert (ours.sampling.top_k, ours.sampling.max_tokens) == (2**31 - 1, 2**31 - 1)


def test_logprobs_zero_still_reports_the_sampled_token() -> None:
    assert convert.to_espalier_request(request(logprobs=0)).sampling.logprobs == 1
    assert convert.to_espalier_request(request(logprobs=5)).sampling.logprobs == 5
    assert convert.to_espalier_request(request()).sampling.logprobs == 0


def test_text_input_is_a_text_prompt() -> None:
    msg = vpb.GenerateRequest(request_id="t", text="hello")
    assert convert.to_espalier_request(msg).text == "hello"


def test_refusals_name_every_field_at_once() -> None:
    msg = request(repetition_penalty=1.3, n=3, min_tokens=2, logit_bias={5: 1.0}, prompt_logprobs=1)
    with pytest.raises(InvalidRequestError) as info:
        convert.to_espalier_request(msg)
    fields = {v.field for v in info.value.violations}
    assert fields == {
        "sampling_params.repetition_penalty",
        "sampling_params.n",
        "sampling_params.min_tokens",
        "sampling_params.logit_bias",
        "sampling_params.prompt_logprobs",
    }
    assert all(f in str(info.value) for f in fields)


def test_structural_tag_and_reasoning_map_onto_the_constraint() -> None:
    tag = '{"type": "structural_tag", "format": {"type": "any_text"}}'
    ours = convert.to_espalier_request(request(structural_tag=tag))
    assert ours.constraint.structural_tag == tag and not ours.constraint.after_reasoning
    # a reasoning model: the grammar starts after the marker unless SMG led the prompt past it
    assert convert.to_espalier_request(request(regex="a+"), "</think>").constraint.after_reasoning
    led = request(regex="a+", grammar_from_first_token=True)
    assert not convert.to_espalier_request(led, "</think>").constraint.after_reasoning
    free = convert.to_espalier_request(request(), "</think>")
    assert free.constraint.WhichOneof("kind") is None and not free.constraint.after_reasoning
    assert convert.constrained_decoding_start("</think>") == "after_reasoning"
    assert convert.constrained_decoding_start("") == "first_token"


def test_neutral_penalties_pass() -> None:
    convert.to_espalier_request(request(repetition_penalty=1.0, frequency_penalty=0.0))


def chunk(ids: list[int], **final: Any) -> pb.GenerateResponse:
    logprobs = [
        pb.TokenLogprob(
            token_id=i,
            logprob=-0.5,
            top=[pb.TopLogprob(token_id=i, logprob=-0.5), pb.TopLogprob(token_id=0, logprob=-2)],
        )
        for i in ids
    ]
    return pb.GenerateResponse(token_ids=ids, logprobs=logprobs, **final)


def test_stream_sends_deltas_and_a_complete_with_the_last_delta() -> None:
    state = convert.StreamState(prompt_tokens=3, want_logprobs=1)
    first, last = chunk([10, 11]), chunk([12], finished=True)
    last.finish_reason = pb.FINISH_REASON_GRAMMAR
    last.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=3, cached_prompt_tokens=1))
    out = []
    for c in (first, last):
        state.record(c)
        out.append(convert.chunk_response(c, state))
    out.append(convert.complete_response(last, state, stream=True))
    assert [list(r.chunk.token_ids) for r in out[:2]] == [[10, 11], [12]]
    assert out[0].chunk.completion_tokens == 2 and out[0].chunk.prompt_tokens == 3
    top = out[0].chunk.output_logprobs.top_logprobs[0]
    assert list(top.token_ids) == [10]  # trimmed to the requested top-n
    complete = out[2].complete
    assert list(complete.output_ids) == [12] and complete.finish_reason == "stop"
    assert (complete.prompt_tokens, complete.completion_tokens, complete.cached_tokens) == (3, 3, 1)


def test_unary_complete_carries_every_token() -> None:
    state = convert.StreamState(prompt_tokens=3, want_logprobs=None)
    pieces = [chunk([10]), chunk([11, 12], finished=True)]
    pieces[-1].finish_reason = pb.FINISH_REASON_LENGTH
    for c in pieces:
        state.record(c)
    complete = convert.complete_response(pieces[-1], state, stream=False).complete
    assert list(complete.output_ids) == [10, 11, 12]
    assert complete.finish_reason == "length" and complete.completion_tokens == 3
    assert not complete.HasField("output_logprobs")  # not asked for


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (pb.FINISH_REASON_STOP, "stop"),
        (pb.FINISH_REASON_GRAMMAR, "stop"),
        (pb.FINISH_REASON_LENGTH, "length"),
        (pb.FINISH_REASON_LENGTH_UNCLOSED, "length"),  # OpenAI's words have no unclosed cut
        (pb.FINISH_REASON_ABORT, "abort"),
    ],
)
def test_finish_reasons(reason: int, expected: str) -> None:
    last = chunk([], finished=True, finish_reason=reason)
    state = convert.StreamState(prompt_tokens=0, want_logprobs=None)
    assert convert.complete_response(last, state, stream=True).complete.finish_reason == expected


def test_the_trailing_metadata_keeps_espaliers_finish_reason() -> None:
    assert convert.finish_metadata(pb.FINISH_REASON_LENGTH_UNCLOSED) == (
        ("espalier-finish-reason", "length_unclosed"),
    )
    assert convert.finish_metadata(pb.FINISH_REASON_GRAMMAR) == (
        ("espalier-finish-reason", "grammar"),
    )


def test_status_messages_spell_out_field_violations_in_worker_terms() -> None:
    from espalier.server.errors import Violation, to_grpc_status

    exc = InvalidRequestError(
        "invalid request fields: sampling.max_tokens",
        violations=[
            Violation("sampling.max_tokens", "must be <= 8192"),
            Violation("constraint.choice.options", "must not be empty"),
        ],
    )
    status = convert.spell_out(to_grpc_status(exc))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.max_tokens: must be <= 8192" in status.details
    assert "sampling_params.choice.choices: must not be empty" in status.details
    # The details stay machine-readable for other clients.
    assert dict(status.trailing_metadata)["grpc-status-details-bin"]


def test_statuses_without_violations_are_unchanged() -> None:
    from espalier.server.errors import to_grpc_status

    status = to_grpc_status(RuntimeError("boom"))
    assert convert.spell_out(status) is status


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("constraint.json_schema#/properties/a", "sampling_params.json_schema#/properties/a"),
        ("constraint.ebnf:1:4", "sampling_params.grammar:1:4"),
        ("sampling.top_p", "sampling_params.top_p"),
        ("token_ids.ids[3]", "tokenized.input_ids[3]"),
        ("request_id", "request_id"),
    ],
)
def test_worker_field_names(ours: str, theirs: str) -> None:
    assert convert.worker_field(ours) == theirs
