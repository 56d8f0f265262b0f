"""The engine core sends token ids; the text is made from them (``engine/output.py``).

``espalier serve``'s path, without its sockets: :class:`EngineCore` steps, each step's chunks
cross as :class:`StepOutputs` (pickled, as the pipe sends them), and an
:class:`OutputProcessor` on the other side makes the text. It must give what the in-process
:class:`Engine` gives, chunk by chunk: text with stop strings cut and characters split across
tokens held back, finish reasons, post-validation verdicts (failing ones and replays included)
- and no text may cross.

The model loops on ``aé世!`` over the toy byte-level vocabulary: é is two tokens, 世 three, so
greedy output is that text again and again, split mid-character at most token boundaries.
"""

from __future__ import annotations

import pickle
import pickletools
from typing import Any

import pytest

from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import FinishReason, GenerationRequest, RequestOutput, SamplingParams
from espalier.engine.core.messages import StepOutputs
from espalier.engine.engine import Engine, EngineCore
from espalier.engine.output import OutputProcessor
from tests.fixtures.looping_model import looping_engine

LOOP = "aé世!"
CYCLE = "(aé世!)+"


def requests() -> list[GenerationRequest]:
    def req(name: str, max_tokens: int, **kw: Any) -> GenerationRequest:
        stop = kw.pop("stop", ())
        return GenerationRequest(
            name,
            prompt=LOOP,
            sampling=SamplingParams(max_tokens=max_tokens, stop=stop, ignore_eos=True),
            **kw,
        )

    return [
        req("plain", 12),  # ends inside 世: the held bytes flush as U+FFFD
        req("stop", 40, stop=("世!a",)),  # a stop string across characters and steps
        req("stop-early", 40, stop=("é", "!")),  # the first to complete wins
        req("stop-unseen", 10, stop=("zz",)),  # a stop string that never comes
        req("regex-ok", 14, grammar=GrammarSpec.regex(CYCLE)),  # complete: valid
        req("regex-cut", 5, grammar=GrammarSpec.regex(CYCLE)),  # cut mid-cycle: invalid
        req("ebnf", 7, grammar=GrammarSpec.ebnf('root ::= ("aé世!")+')),  # replay verdict
    ]


def served(core: EngineCore, batch: list[GenerationRequest]) -> tuple[list[Any], list[bytes]]:
    """Chunks through the wire form and a server-side OutputProcessor; the pickled messages."""
    text = OutputProcessor(
        core.tokenizer, lambda spec, opts: core.grammar.submit(spec, opts).result()[0]
    )
    for request in batch:
        text.add(request)
        core.add_request(request)
    chunks, wire = [], []
    while core.has_unfinished():
        message = pickle.dumps(StepOutputs.pack(core.step(), {}, 0))
        wire.append(message)
        chunks.extend(text.process(pickle.loads(message).outputs()))
    return chunks, wire


def offline(engine: Engine, batch: list[GenerationRequest]) -> list[RequestOutput]:
    for request in batch:
        engine.add_request(request)
    chunks = []
    while engine.has_unfinished():
        chunks.extend(engine.step())
    return chunks


def view(chunks: list[Any]) -> dict[str, list[tuple[Any, ...]]]:
    """What a client sees, per request, chunk by chunk."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for c in chunks:
        seen = (c.token_ids, c.text_delta, c.finished, c.finish_reason, c.validation, c.error)
        out.setdefault(c.request_id, []).append(seen)
    return out


@pytest.fixture(scope="module")
def both() -> tuple[dict[str, Any], dict[str, Any], list[bytes]]:
    batch = requests()
    engine = looping_engine(LOOP, close_within_budget=False)
    core = looping_engine(LOOP, close_within_budget=False, engine_type=EngineCore)
    try:
        ours = offline(engine, batch)
        theirs, wire = served(core, batch)
    finally:
        engine.close()
        core.close()
    return view(ours), view(theirs), wire


def text_of(chunks: list[tuple[Any, ...]]) -> str:
    return "".join(c[1] for c in chunks)


def test_served_chunks_equal_the_in_process_engines(both: Any) -> None:
    ours, theirs, _ = both
    assert set(ours) == {r.request_id for r in requests()}
    assert theirs == ours


def test_the_text_is_right(both: Any) -> None:
    _, theirs, _ = both
    loop = LOOP * 10
    plain = theirs["plain"]
    assert len(plain) > 2 and plain[-1][3] is FinishReason.LENGTH
    # 12 tokens: aé世! (7) then aé and the first byte of 世, which can never complete
    assert text_of(plain) == loop[:6] + "\ufffd"
    for chunk in plain[:-1]:
        assert "\ufffd" not in chunk[1]  # a character split across steps is held, not broken
    stop = theirs["stop"]
    assert text_of(stop) == "aé" and stop[-1][3] is FinishReason.STOP
    early = theirs["stop-early"]
    assert text_of(early) == "a" and early[-1][3] is FinishReason.STOP
    unseen = theirs["stop-unseen"]
    assert text_of(unseen) == "aé世!aé" and unseen[-1][3] is FinishReason.LENGTH


def test_post_validation_verdicts(both: Any) -> None:
    _, theirs, _ = both
    ok, cut, ebnf = theirs["regex-ok"][-1], theirs["regex-cut"][-1], theirs["ebnf"][-1]
    assert ok[3] is FinishReason.LENGTH and ok[4].checked and ok[4].valid
    assert text_of(theirs["regex-ok"]) == LOOP * 2
    assert cut[3] is FinishReason.LENGTH_UNCLOSED  # closing off: an unfinished prefix
    assert cut[4].checked and not cut[4].valid and cut[4].errors
    assert ebnf[4].checked and ebnf[4].valid  # replayed through a matcher of the grammar
    assert theirs["plain"][-1][4] is None  # unconstrained: no verdict


def test_no_text_crosses(both: Any) -> None:
    _, _, wire = both
    assert len(wire) > 3
    for message in wire:
        # every string and bytes value the pickle holds (its floats, timings among them, may
        # hold any byte pair, so the raw message is not searched)
        texts = [arg for _, arg, _ in pickletools.genops(message) if isinstance(arg, str | bytes)]
        for text in texts:
            raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
            assert "世".encode() not in raw and "é".encode() not in raw, text
        step = pickle.loads(message)
        assert all(len(row) == 3 and isinstance(row[1], tuple) for row in step.rows)
        assert all(out.text_delta == "" and out.validation is None for out in step.finished)


def test_a_failing_post_validation_ends_the_request_with_an_error() -> None:
    """Nothing accepted is lost: a validator that raises (here the replay's compile) still
    ends the stream, with ERROR and a message naming only the exception's type."""
    from tests.fixtures.tokenizers import toy_tokenizer

    def broken(spec: Any, options: Any) -> Any:
        raise MemoryError("no room to compile")

    tokenizer = toy_tokenizer()
    text = OutputProcessor(tokenizer, broken)
    request = GenerationRequest("r", prompt="x", grammar=GrammarSpec.ebnf('root ::= "ab"'))
    text.add(request)
    ids = tuple(tokenizer.encode("ab"))
    done = RequestOutput("r", "", ids, finished=True, finish_reason=FinishReason.STOP)
    (out,) = text.process([done])
    assert out.finished and out.finish_reason is FinishReason.ERROR
    assert out.error == "internal error in this request's step: MemoryError"
    assert out.validation is None
    # its state is gone: a late chunk for it passes through untouched
    late = RequestOutput("r", "", ids)
    assert text.process([late]) == [late] and late.text_delta == ""
