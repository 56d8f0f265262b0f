"""SMG's ``vllm.grpc.engine`` messages ↔ espalier's own request and engine outputs.

A worker request is first rewritten as an ``espalier.v1.GenerateRequest`` so that it goes
through the one validation path every espalier request takes (``server/convert.py``); fields
espalier cannot honour are refused here by name rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from smg_grpc_proto import vllm_engine_pb2 as vpb

from espalier.server.errors import InvalidRequestError, Violation
from espalier.v1 import espalier_pb2 as pb

# vLLM's defaults for fields proto3 cannot leave unset: 0 means "off" for these.
_NEUTRAL_PENALTIES = {
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (0.0, 1.0),
}
_DETAILS_KEY = "grpc-status-details-bin"
# The one worker message field that says which prompt was sent, and which are out of scope.
_UNSUPPORTED_REQUEST_FIELDS = ("mm_inputs", "media_refs", "kv_transfer_params")

# Finish reasons in the worker protocol's words ("stop" when the grammar completed: the
# answer ended where the constraint allows it to, as vLLM reports it; OpenAI's words have no
# unclosed length, so it reads "length" there and espalier's own name travels in the trailing
# metadata, see FINISH_METADATA_KEY).
FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_GRAMMAR: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_LENGTH_UNCLOSED: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}
# The worker's GenerateComplete has no free-form field (matched_stop names a stop that matched),
# so the finished stream's trailing metadata carries espalier's own reason, e.g.
# "length_unclosed", for callers of the worker that want the distinction.
FINISH_METADATA_KEY = "espalier-finish-reason"


def finish_metadata(reason: int) -> tuple[tuple[str, str], ...]:
    """Trailing metadata naming espalier's finish reason (``pb.FinishReason`` value)."""
    name = pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
    return ((FINISH_METADATA_KEY, name),)


def grammar_is_lark(grammar: str) -> bool:
    """vLLM's ``grammar`` field carries EBNF (GBNF rules, ``root ::= ...``) or Lark (``:``)."""
    return "::=" not in grammar


def _constraint(params: vpb.SamplingParams, bad: list[Violation]) -> pb.Constraint:
    kind = params.WhichOneof("constraint")
    if kind == "json_schema":
        return pb.Constraint(json_schema=params.json_schema)
    if kind == "regex":
        return pb.Constraint(regex=params.regex)
    if kind == "grammar":
        if grammar_is_lark(params.grammar):
            return pb.Constraint(lark=params.grammar)
        return pb.Constraint(ebnf=params.grammar)
    if kind == "choice":
        return pb.Constraint(choice=pb.Choice(options=list(params.choice.choices)))
    if kind == "json_object":
        return pb.Constraint(any_json=pb.AnyJson()) if params.json_object else pb.Constraint()
    if kind == "structural_tag":
        return pb.Constraint(structural_tag=params.structural_tag)
    return pb.Constraint()


def constrained_decoding_start(reasoning_end: str) -> str:
    """Where this worker starts a request's grammar, in SMG's words: after the model's
    reasoning end marker when one is configured, else from the first token."""
    return "after_reasoning" if reasoning_end else "first_token"


def _refusals(msg: vpb.GenerateRequest, bad: list[Violation]) -> None:
    """Fields with a meaning espalier does not implement: refused, never silently dropped."""
    params = msg.sampling_params
    for name in _UNSUPPORTED_REQUEST_FIELDS:
        if msg.HasField(name):
            bad.append(Violation(name, "not supported by espalier (text-only model)"))
    if msg.extra_mm_inputs:
        bad.append(Violation("extra_mm_inputs", "not supported by espalier (text-only model)"))
    for name, neutral in _NEUTRAL_PENALTIES.items():
        if getattr(params, name) not in neutral:
            bad.append(Violation(f"sampling_params.{name}", "penalties are not supported"))
    if params.min_tokens > 0:
        bad.append(Violation("sampling_params.min_tokens", "not supported; must be 0"))
    if params.n > 1:
        bad.append(Violation("sampling_params.n", "one completion per request; must be <= 1"))
    if params.logit_bias:
        bad.append(Violation("sampling_params.logit_bias", "not supported"))
    if params.HasField("prompt_logprobs"):
        bad.append(Violation("sampling_params.prompt_logprobs", "not supported"))
    if params.HasField("truncate_prompt_tokens"):
        bad.append(Violation("sampling_params.truncate_prompt_tokens", "not supported"))
    if params.HasField("logprobs") and not 0 <= params.logprobs <= 20:
        bad.append(Violation("sampling_params.logprobs", "must be in [0, 20]"))


_INT32_MAX = 2**31 - 1


def _sampling(params: vpb.SamplingParams) -> pb.SamplingParams:
    out = pb.SamplingParams(
        # vLLM's default temperature is 1.0; an explicit 0 is greedy.
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        # SMG's counts are uint32, ours int32: past 2**31 - 1 both mean "no limit" (top_k) or
        # more than --max-max-tokens allows (refused by espalier's own check)
        top_k=min(params.top_k, _INT32_MAX),
        top_p=params.top_p if params.top_p != 0.0 else 1.0,
        min_p=params.min_p,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.HasField("max_tokens"):
        out.max_tokens = min(params.max_tokens, _INT32_MAX)
    if params.HasField("seed"):
        out.seed = params.seed
    if params.HasField("logprobs") and 0 <= params.logprobs <= 20:
        # vLLM's logprobs=0 still reports the sampled token's own logprob; ours needs >= 1.
        out.logprobs = max(1, params.logprobs)
    return out


def to_espalier_request(msg: vpb.GenerateRequest, reasoning_end: str = "") -> pb.GenerateRequest:
    """The same request in espalier's words; raises InvalidRequestError naming refused fields.

    With a reasoning end marker configured, a constraint starts after it unless SMG says it
    already led the prompt past the thought (``grammar_from_first_token``).
    """
    bad: list[Violation] = []
    _refusals(msg, bad)
    constraint = _constraint(msg.sampling_params, bad)
    if reasoning_end and constraint.WhichOneof("kind") is not None:
        constraint.after_reasoning = not msg.sampling_params.grammar_from_first_token
    if bad:
        fields = "; ".join(f"{v.field}: {v.description}" for v in bad)
        raise InvalidRequestError(f"invalid request: {fields}", violations=bad)
    request = pb.GenerateRequest(
        request_id=msg.request_id,
        sampling=_sampling(msg.sampling_params),
        constraint=constraint,
    )
    if msg.WhichOneof("input") == "tokenized":
        request.token_ids.ids.extend(msg.tokenized.input_ids)
    elif msg.WhichOneof("input") == "text":
        request.text = msg.text
    return request


@dataclass
class StreamState:
    """What one worker stream has seen so far (chunks carry deltas, the complete the total)."""

    prompt_tokens: int
    want_logprobs: int | None  # the request's ``logprobs`` (None: not asked for)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)

    def record(self, chunk: pb.GenerateResponse) -> None:
        self.output_ids.extend(chunk.token_ids)
        if self.want_logprobs is not None:
            self.logprobs.extend(chunk.logprobs)


def _output_logprobs(entries: Iterable[pb.TokenLogprob], top_n: int) -> vpb.OutputLogProbs:
    msg = vpb.OutputLogProbs()
    for entry in entries:
        msg.token_ids.append(entry.token_id)
        msg.token_logprobs.append(entry.logprob)
        if top_n > 0:
            top = entry.top[:top_n]
            msg.top_logprobs.add(
                token_ids=[t.token_id for t in top], values=[t.logprob for t in top]
            )
    return msg


def chunk_response(chunk: pb.GenerateResponse, state: StreamState) -> vpb.GenerateResponse:
    """One streamed delta in the worker protocol."""
    out = vpb.GenerateStreamChunk(
        token_ids=chunk.token_ids,
        prompt_tokens=state.prompt_tokens,
        completion_tokens=len(chunk.token_ids),
    )
    if state.want_logprobs is not None and chunk.logprobs:
        out.output_logprobs.CopyFrom(_output_logprobs(chunk.logprobs, state.want_logprobs))
    return vpb.GenerateResponse(chunk=out)


def complete_response(
    last: pb.GenerateResponse, state: StreamState, *, stream: bool
) -> vpb.GenerateResponse:
    """The final message: the last delta when streaming (SMG accumulates), else every token."""
    usage = last.usage if last.HasField("usage") else None
    complete = vpb.GenerateComplete(
        output_ids=last.token_ids if stream else state.output_ids,
        finish_reason=FINISH_REASONS.get(last.finish_reason, "stop"),
        prompt_tokens=usage.prompt_tokens if usage else state.prompt_tokens,
        completion_tokens=usage.completion_tokens if usage else len(state.output_ids),
        cached_tokens=usage.cached_prompt_tokens if usage else 0,
    )
    entries = last.logprobs if stream else state.logprobs
    if state.want_logprobs is not None and entries:
        complete.output_logprobs.CopyFrom(_output_logprobs(entries, state.want_logprobs))
    if last.HasField("speculative"):
        complete.spec_accepted_tokens = last.speculative.accepted_tokens
        complete.spec_draft_tokens = last.speculative.draft_tokens
    return vpb.GenerateResponse(complete=complete)


# espalier.v1 request fields as the worker protocol names them (longest prefix first).
_FIELD_NAMES = (
    ("constraint.choice.options", "sampling_params.choice.choices"),
    ("constraint.ebnf", "sampling_params.grammar"),
    ("constraint.lark", "sampling_params.grammar"),
    ("constraint.any_json", "sampling_params.json_object"),
    ("constraint.", "sampling_params."),
    ("sampling.", "sampling_params."),
    ("token_ids.ids", "tokenized.input_ids"),
)


def worker_field(name: str) -> str:
    """An espalier.v1 field path in the worker protocol's words (unknown ones unchanged)."""
    for ours, theirs in _FIELD_NAMES:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def spell_out(status: grpc.Status) -> grpc.Status:
    """The same status, its BadRequest field violations also written into the message.

    SMG hands the HTTP client the status message only, so "invalid request fields: x" becomes
    "invalid request fields: x (sampling_params.max_tokens: must be <= 8192)".
    """
    details = dict(status.trailing_metadata or ()).get(_DETAILS_KEY)
    if not isinstance(details, bytes):
        return status
    rich = status_pb2.Status.FromString(details)
    violations = []
    for packed in rich.details:
        bad = error_details_pb2.BadRequest()
        if packed.Unpack(bad):
            violations += [
                f"{worker_field(v.field)}: {v.description}"
                for v in bad.field_violations
                if v.description not in rich.message
            ]
    if not violations:
        return status
    rich.message = f"{rich.message} ({'; '.join(violations)})"[:4096]
    return rpc_status.to_status(rich)
