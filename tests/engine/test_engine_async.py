"""AsyncEngine: streams equal the sync engine, cancel frees blocks, queue limit, typed errors,
graceful shutdown."""

from __future__ import annotations

import asyncio

import pytest

from espalier.constrained.errors import GrammarError
from espalier.constrained.spec import GrammarSpec
from espalier.engine.api import FinishReason, GenerationRequest, InvalidRequestError, RequestOutput
from espalier.engine.async_engine import (
    AsyncEngine,
    AsyncEngineConfig,
    EngineClosedError,
    QueueFullError,
)
from tests.fixtures.engine_fixtures import make_engine, run_all, tokens_of


def request(i: int, max_tokens: int = 10, **kw: object) -> GenerationRequest:
    from espalier.engine.api import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i)
    return GenerationRequest(f"q{i}", prompt=f"hello {i} world", sampling=sampling, **kw)  # type: ignore[arg-type]


async def collect(engine: AsyncEngine, req: GenerationRequest) -> list[RequestOutput]:
    return [out async for out in engine.generate(req)]


def test_concurrent_streams_equal_sync_engine() -> None:
    want = run_all(make_engine(), [request(i) for i in range(6)])

    async def main() -> list[list[RequestOutput]]:
        engine = AsyncEngine(make_engine())
        try:
            return await asyncio.gather(*(collect(engine, request(i)) for i in range(6)))
        finally:
            await engine.shutdown()

    got = asyncio.run(main())
    for i, chunks in enumerate(got):
        assert chunks[-1].finished and sum(c.finished for c in chunks) == 1
        assert tokens_of(chunks) == tokens_of(want[f"q{i}"])


def test_cancel_mid_stream_aborts_and_frees_blocks() -> None:
    async def main() -> None:
        sync = make_engine()
        engine = AsyncEngine(sync)
        try:
            stream = engine.generate(request(1, max_tokens=200))
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.aclose()  # what a cancelled gRPC handler does
            for _ in range(200):
                stats = engine.stats()
                if stats["running"] == 0 and stats["waiting"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert engine.stats()["free_blocks"] == sync.pool.num_blocks
            # explicit abort of a live request ends its stream with ABORT
            chunks: list[RequestOutput] = []

            async def consume() -> None:
                async for out in engine.generate(request(2, max_tokens=500)):
                    chunks.append(out)
                    if len(chunks) == 2:
                        engine.abort("q2")

            await consume()
            assert chunks[-1].finish_reason is FinishReason.ABORT
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_typed_errors_before_any_output() -> None:
    async def main() -> None:
        engine = AsyncEngine(make_engine())
        try:
            with pytest.raises(InvalidRequestError):
                await collect(engine, request(1, max_tokens=0))
            with pytest.raises(GrammarError):
                await collect(engine, request(2, grammar=GrammarSpec.regex("(oops")))
            ok = await collect(engine, request(3))
            assert ok[-1].finished
        finally:
            await engine.shutdown()
        with pytest.raises(EngineClosedError):
            await collect(engine, request(4))

    asyncio.run(main())


def test_queue_full() -> None:
    async def main() -> None:
        engine = AsyncEngine(make_engine(max_num_seqs=1), AsyncEngineConfig(max_waiting=2))
        try:
            tasks = [asyncio.create_task(collect(engine, request(0, 30)))]
            while engine.stats()["running"] < 1:
                await asyncio.sleep(0.01)
            tasks += [asyncio.create_task(collect(engine, request(i, 30))) for i in (1, 2)]
            while engine.stats()["waiting"] < 2:  # one running, two waiting
                await asyncio.sleep(0.01)
            with pytest.raises(QueueFullError):
                await collect(engine, request(9))
            done = await asyncio.gather(*tasks)
            assert all(chunks[-1].finished for chunks in done)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_shutdown_drains_in_flight_streams() -> None:
    async def main() -> None:
        engine = AsyncEngine(make_engine())
        tasks = [asyncio.create_task(collect(engine, request(i, 15))) for i in range(3)]
        await asyncio.sleep(0.05)
        await engine.shutdown(drain=True)
        done = await asyncio.gather(*tasks)
        for chunks in done:
            assert chunks[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert not engine.is_running

    asyncio.run(main())


def test_shutdown_without_drain_aborts() -> None:
    async def main() -> None:
        engine = AsyncEngine(make_engine())
        tasks = [asyncio.create_task(collect(engine, request(i, 500))) for i in range(2)]
        while engine.stats()["running"] < 2:
            await asyncio.sleep(0.01)
        await engine.shutdown(drain=False)
        done = await asyncio.gather(*tasks)
        assert all(chunks[-1].finish_reason is FinishReason.ABORT for chunks in done)

    asyncio.run(main())
