"""A lagging stream reader gets what piled up as one chunk: tokens, text and logprobs joined in
order, the final fields kept, never past a finished chunk, and an engine failure queued behind
them still raised after them (``server.engine_process.coalesce``, ``RequestOutput.followed_by``)."""

from __future__ import annotations

import asyncio

from espalier.engine.api import FinishReason, RequestOutput, TokenLogprob, Usage
from espalier.server.engine_process import EngineUnavailableError, coalesce


def _chunk(ids: tuple[int, ...], text: str, **final: object) -> RequestOutput:
    logprobs = tuple(TokenLogprob(t, -float(t)) for t in ids)
    return RequestOutput("r", text, ids, logprobs=logprobs, **final)  # type: ignore[arg-type]


def _queue(*items: RequestOutput | BaseException) -> asyncio.Queue[RequestOutput | BaseException]:
    queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_queued_chunks_join_up_to_the_finished_one() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=5)
    last = _chunk((5,), "!", finished=True, finish_reason=FinishReason.STOP, usage=usage)
    after = _chunk((9,), "never")  # another request's reuse of the id would be a bug; not joined
    queue = _queue(_chunk((2, 3), "b"), _chunk((4,), "c"), last, after)
    joined, held = coalesce(_chunk((1,), "a"), queue)
    assert held is None
    assert joined.token_ids == (1, 2, 3, 4, 5)
    assert joined.text_delta == "abc!"
    assert [lp.token_id for lp in joined.logprobs] == [1, 2, 3, 4, 5]
    assert joined.finished and joined.finish_reason is FinishReason.STOP
    assert joined.usage == usage
    assert queue.qsize() == 1  # the chunk after the finished one stays queued


def test_text_tokens_count_from_the_joined_start() -> None:
    # the final chunk's last token (a stop token) makes no text: 1 of its 2 tokens does
    last = _chunk((7, 0), "x", finished=True, finish_reason=FinishReason.STOP, text_tokens=1)
    joined, _ = coalesce(_chunk((5, 6), "ab"), _queue(last))
    assert joined.text_tokens == 3
    joined, _ = coalesce(_chunk((5, 6), "ab"), _queue(_chunk((7,), "c")))
    assert joined.text_tokens is None and not joined.finished


def test_a_failure_behind_the_chunks_is_kept_for_after_them() -> None:
    failure = EngineUnavailableError("the engine process exited")
    queue = _queue(_chunk((2,), "b"), failure, _chunk((3,), "c"))
    joined, held = coalesce(_chunk((1,), "a"), queue)
    assert joined.token_ids == (1, 2) and not joined.finished
    assert held is failure


def test_nothing_queued_leaves_the_chunk_as_it_is() -> None:
    chunk = _chunk((1,), "a")
    joined, held = coalesce(chunk, _queue())
    assert joined is chunk and held is None
