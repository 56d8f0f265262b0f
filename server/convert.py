"""Proto messages ↔ engine dataclasses, validating every field on the way in.

Validation collects all bad fields of a request into one :class:`InvalidRequestError` (a BadRequest
with one field violation each); a malformed grammar raises the grammar layer's own typed error.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

from espalier.constrained.base import CompileReport
from espalier.constrained.errors import KeywordIssue
from espalier.constrained.grammar_limits import DEFAULT_MAX_ALTERNATIVES, check_alternatives
from espalier.constrained.schema.guard import DEFAULT_MAX_SCHEMA_DEPTH, admit_schema
from espalier.constrained.spec import GrammarSpec
from espalier.constrained.structural_tag import admit_structural_tag, after_reasoning
from espalier.engine.api import (
    ConstraintOptions,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    SpeculativeOptions,
)
from espalier.server.chat import ChatPrompt, RenderChat, chat_bytes, prepare_chat
from espalier.server.errors import (
    InvalidRequestError,
    PromptTooLongError,
    Violation,
    grammar_field,
)
from espalier.v1 import espalier_pb2 as pb

SPECULATIVE_METHODS = frozenset({"ngram", "draft", "eagle", "forced"})
BACKEND_ALIASES = {"outlines": "outlines_core"}  # the name the proto documents
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_SEED = (1 << 63) - 1


@dataclass(frozen=True)
class RequestLimits:
    """The server limits a request is checked against (from ServerConfig and the model).

    Byte limits are checked on the raw fields before anything parses or tokenizes them.
    ``speculative_methods``: the drafters this server loaded (None: do not check).
    """

    vocab_size: int
    max_prompt_tokens: int
    max_grammar_bytes: int
    default_max_tokens: int
    max_max_tokens: int
    max_prompt_bytes: int = 1 << 20
    max_stop_bytes: int = 256
    max_choices: int = 1024
    max_grammar_alternatives: int = DEFAULT_MAX_ALTERNATIVES
    max_schema_depth: int = DEFAULT_MAX_SCHEMA_DEPTH
    speculative_methods: frozenset[str] | None = field(default=None)
    reasoning_end: str = ""  # the model's reasoning end marker ("": none configured)


def _too_large(kind: str, size: int, limit: int, unit: str = "bytes") -> InvalidRequestError:
    return InvalidRequestError(
        f"the {kind} constraint is {size} {unit}, over the limit of {limit}",
        violations=[Violation(grammar_field(kind), f"over {limit} {unit}", "TOO_LARGE")],
        metadata={f"limit_{unit}": str(limit), f"size_{unit}": str(size)},
    )


def constraint_to_spec(
    constraint: pb.Constraint, limits: RequestLimits
) -> tuple[GrammarSpec | None, ConstraintOptions]:
    """The grammar (None when unset); raises InvalidRequestError or the grammar errors.

    Sizes (bytes, choice count) are checked before the text is parsed; a schema then goes
    through :func:`admit_schema` (depth, meta-schema, local refs only).
    """
    spec, options = _constraint_kind(constraint, limits)
    if not constraint.after_reasoning:
        return spec, options
    if spec is None or not limits.reasoning_end:
        why = (
            "applies only with a constraint kind set"
            if spec is None
            else "this server has no reasoning end marker (espalier serve --reasoning-end)"
        )
        raise InvalidRequestError(
            f"after_reasoning: {why}", violations=[Violation("constraint.after_reasoning", why)]
        )
    return after_reasoning(spec, limits.reasoning_end), options


def _constraint_kind(
    constraint: pb.Constraint, limits: RequestLimits
) -> tuple[GrammarSpec | None, ConstraintOptions]:
    backend = BACKEND_ALIASES.get(constraint.backend, constraint.backend) or "auto"
    options = ConstraintOptions(backend=backend, allow_weakening=constraint.allow_weakening)
    kind = constraint.WhichOneof("kind")
    if kind is None:
        if backend != "auto":
            raise InvalidRequestError(
                f"backend '{constraint.backend}' is set without a constraint",
                violations=[
                    Violation("constraint.backend", "applies only with a constraint kind set")
                ],
            )
        return None, options
    if kind == "any_json":
        return GrammarSpec.any_json(), options
    max_bytes = limits.max_grammar_bytes
    if kind == "choice":
        options_list = list(constraint.choice.options)
        if len(options_list) > limits.max_choices:
            raise _too_large(kind, len(options_list), limits.max_choices, "options")
        size = sum(len(o.encode("utf-8")) for o in options_list)
    else:
        text: str = getattr(constraint, kind)
        size = len(text.encode("utf-8"))
    if size > max_bytes:
        raise _too_large(kind, size, max_bytes)
    if kind == "json_schema":
        schema = admit_schema(text, limits.max_schema_depth)
        return GrammarSpec.json_schema(schema, max_bytes), options
    if kind == "regex":
        return GrammarSpec.regex(text, max_bytes), options
    if kind == "structural_tag":
        return admit_structural_tag(text, limits.max_schema_depth, max_bytes), options
    if kind in ("ebnf", "lark"):
        spec = (
            GrammarSpec.ebnf(text, max_bytes)
            if kind == "ebnf"
            else GrammarSpec.lark(text, max_bytes)
        )
        check_alternatives(spec, limits.max_grammar_alternatives)
        return spec, options
    return GrammarSpec.choice(options_list), options


def _sampling(
    msg: pb.SamplingParams, limits: RequestLimits, bad: list[Violation]
) -> SamplingParams:
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else limits.default_max_tokens
    for name in ("temperature", "top_p", "min_p"):
        if msg.HasField(name) and not math.isfinite(getattr(msg, name)):
            bad.append(Violation(f"sampling.{name}", "must be a finite number"))
    params = SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p if msg.HasField("min_p") else 0.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=max_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
    )
    named = {v.field for v in bad}
    bad.extend(
        Violation(f"sampling.{name}", text)
        for name, text in params.validate()
        if f"sampling.{name}" not in named
    )
    if max_tokens > limits.max_max_tokens:
        bad.append(Violation("sampling.max_tokens", f"must be <= {limits.max_max_tokens}"))
    if len(params.stop) > MAX_STOP_STRINGS:
        bad.append(Violation("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
    for i, stop in enumerate(params.stop[:MAX_STOP_STRINGS]):
        if not stop:
            bad.append(Violation(f"sampling.stop[{i}]", "must not be empty"))
        elif len(stop.encode("utf-8")) > limits.max_stop_bytes:
            bad.append(Violation(f"sampling.stop[{i}]", f"over {limits.max_stop_bytes} bytes"))
    for i, token in enumerate(params.stop_token_ids):
        if token >= limits.vocab_size:
            bad.append(Violation(f"sampling.stop_token_ids[{i}]", "outside the vocabulary"))
            break
    return params


def _speculative(
    msg: pb.SpeculativeOptions, limits: RequestLimits, bad: list[Violation]
) -> SpeculativeOptions:
    loaded = limits.speculative_methods
    for i, method in enumerate(msg.methods[:8]):
        if method not in SPECULATIVE_METHODS:
            known = ", ".join(sorted(SPECULATIVE_METHODS))
            bad.append(Violation(f"speculative.methods[{i}]", f"unknown method; one of {known}"))
        elif loaded is not None and method not in loaded:
            have = ", ".join(sorted(loaded)) or "none"
            bad.append(
                Violation(
                    f"speculative.methods[{i}]",
                    f"'{method}' is not loaded on this server; loaded: {have}",
                )
            )
    if len(msg.methods) > 8:
        bad.append(Violation("speculative.methods", "at most 8 methods"))
    num = msg.num_draft_tokens if msg.HasField("num_draft_tokens") else None
    if num is not None and not 1 <= num <= 1024:
        bad.append(Violation("speculative.num_draft_tokens", "must be in [1, 1024]"))
    return SpeculativeOptions(
        enabled=msg.enabled if msg.HasField("enabled") else None,
        methods=tuple(msg.methods),
        num_draft_tokens=num,
    )


def _prompt(
    msg: pb.GenerateRequest,
    limits: RequestLimits,
    count_tokens: object,
    bad: list[Violation],
    chat: ChatPrompt | None = None,
) -> tuple[str | None, tuple[int, ...] | None]:
    which = msg.WhichOneof("prompt")
    if which is None:
        bad.append(Violation("prompt", "set text, token_ids or chat"))
        return None, None
    if which == "chat":
        ids: tuple[int, ...] | None = chat.token_ids if chat is not None else ()
        n_tokens = len(ids or ())
        text = None
    elif which == "token_ids":
        ids = tuple(msg.token_ids.ids)
        if not ids:
            bad.append(Violation("token_ids.ids", "must not be empty"))
        for i, token in enumerate(ids):
            if token >= limits.vocab_size:
                bad.append(Violation(f"token_ids.ids[{i}]", f"{token} is outside the vocabulary"))
                break
        n_tokens = len(ids)
        text = None
    else:
        text, ids = msg.text, None
        n_bytes = len(text.encode("utf-8"))
        if n_bytes > limits.max_prompt_bytes:
            raise PromptTooLongError(
                f"the prompt is {n_bytes} bytes, over the limit of {limits.max_prompt_bytes}",
                violations=[Violation(which, f"over {limits.max_prompt_bytes} bytes", "TOO_LONG")],
                metadata={"limit_bytes": str(limits.max_prompt_bytes), "bytes": str(n_bytes)},
            )
        n_tokens = count_tokens(text) if callable(count_tokens) else 0
    if n_tokens > limits.max_prompt_tokens:
        raise PromptTooLongError(
            f"the prompt has {n_tokens} tokens, over the limit of {limits.max_prompt_tokens}",
            violations=[Violation(which, f"over {limits.max_prompt_tokens} tokens", "TOO_LONG")],
            metadata={"limit_tokens": str(limits.max_prompt_tokens), "tokens": str(n_tokens)},
        )
    return text, ids


def request_from_proto(
    msg: pb.GenerateRequest,
    limits: RequestLimits,
    count_tokens: object = None,
    render_chat: RenderChat | None = None,
) -> GenerationRequest:
    """Validate and convert; ``count_tokens(text) -> int`` measures text prompts and
    ``render_chat`` renders a chat prompt with the model's template."""
    bad: list[Violation] = []
    request_id = msg.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        bad.append(Violation("request_id", f"at most {MAX_REQUEST_ID_CHARS} printable characters"))
    sampling = _sampling(msg.sampling, limits, bad)
    speculative = _speculative(msg.speculative, limits, bad)
    chat = _chat(msg, limits, render_chat, bad)
    text, ids = _prompt(msg, limits, count_tokens, bad, chat)
    if bad:
        raise _invalid_fields(bad)
    grammar, options = constraint_to_spec(msg.constraint, limits)
    if chat is not None and chat.grammar is not None:
        if grammar is not None:
            why = "a forced tool call is the constraint; leave constraint unset"
            raise _invalid_fields([Violation("chat.tool_choice", why)])
        grammar = chat.grammar
    return GenerationRequest(
        request_id=request_id,
        prompt=text,
        prompt_token_ids=ids,
        sampling=sampling,
        grammar=grammar,
        constraint=options,
        speculative=speculative,
    )


def _chat(
    msg: pb.GenerateRequest,
    limits: RequestLimits,
    render_chat: RenderChat | None,
    bad: list[Violation],
) -> ChatPrompt | None:
    if msg.WhichOneof("prompt") != "chat":
        return None
    size = chat_bytes(msg.chat)
    if size > limits.max_prompt_bytes:
        raise PromptTooLongError(
            f"the chat is {size} bytes, over the limit of {limits.max_prompt_bytes}",
            violations=[Violation("chat", f"over {limits.max_prompt_bytes} bytes", "TOO_LONG")],
            metadata={"limit_bytes": str(limits.max_prompt_bytes), "bytes": str(size)},
        )
    return prepare_chat(msg.chat, render_chat, bad)


def _invalid_fields(bad: list[Violation]) -> InvalidRequestError:
    fields = ", ".join(v.field for v in bad[:8]) + (", ..." if len(bad) > 8 else "")
    return InvalidRequestError(f"invalid request fields: {fields}", violations=bad)


_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.LENGTH_UNCLOSED: pb.FINISH_REASON_LENGTH_UNCLOSED,
    FinishReason.GRAMMAR: pb.FINISH_REASON_GRAMMAR,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def keyword_issue_to_proto(issue: KeywordIssue) -> pb.KeywordIssue:
    return pb.KeywordIssue(
        keyword=issue.keyword, pointer=issue.pointer, support=issue.support, backend=issue.backend
    )


def output_to_proto(out: RequestOutput) -> pb.GenerateResponse:
    """One streamed chunk; final fields only on the last one."""
    msg = pb.GenerateResponse(
        request_id=out.request_id, text=out.text_delta, token_ids=list(out.token_ids)
    )
    for lp in out.logprobs:
        msg.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
        )
    if not out.finished:
        return msg
    msg.finished = True
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH[out.finish_reason]
    msg.backend = out.backend
    msg.weakened.extend(keyword_issue_to_proto(w) for w in out.weakened)
    if out.usage is not None:
        u = out.usage
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
            )
        )
    if out.timings is not None:
        t = out.timings
        msg.timings.CopyFrom(
            pb.Timings(
                queue_seconds=t.queue_s,
                compile_seconds=t.compile_s,
                compile_queue_seconds=t.compile_queue_s,
                compile_run_seconds=t.compile_run_s,
                prefill_seconds=t.prefill_s,
                decode_seconds=t.decode_s,
                mask_seconds=t.mask_s,
                first_token_seconds=t.first_token_s,
                total_seconds=t.total_s,
            )
        )
    if out.speculative is not None:
        s = out.speculative
        msg.speculative.CopyFrom(
            pb.SpeculativeStats(
                steps=s.steps,
                draft_tokens=s.draft_tokens,
                accepted_tokens=s.accepted_tokens,
                forced_tokens=s.forced_tokens,
                mean_accept_length=s.mean_accept_length,
                draft_seconds=s.draft_s,
                mask_seconds=s.mask_s,
                verify_seconds=s.verify_s,
            )
        )
    if out.validation is not None:
        v = out.validation
        msg.validation.CopyFrom(
            pb.ValidationResult(checked=v.checked, valid=v.valid, errors=list(v.errors))
        )
    return msg


def merge_unary(chunks: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """Fold streamed chunks into one response: whole text and token ids, the last chunk's finals."""
    merged = pb.GenerateResponse()
    merged.CopyFrom(chunks[-1])
    merged.text = "".join(c.text for c in chunks)
    del merged.token_ids[:]
    merged.token_ids.extend(t for c in chunks for t in c.token_ids)
    del merged.logprobs[:]
    merged.logprobs.extend(lp for c in chunks for lp in c.logprobs)
    return merged


def compile_report_to_proto(report: CompileReport) -> pb.CompileGrammarResponse:
    return pb.CompileGrammarResponse(
        backend=report.backend,
        weakened=[keyword_issue_to_proto(w) for w in report.weakened],
        compile_seconds=report.compile_seconds,
        cache_hit=report.cache_hit,
        cache_key=report.cache_key,
        notes=list(report.notes),
        queue_seconds=report.queue_seconds,
    )
