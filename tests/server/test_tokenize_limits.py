"""Tokenize of a text every admission limit takes, whose reply would pass the message limit:
INVALID_ARGUMENT naming the limit (gRPC would refuse to send it as RESOURCE_EXHAUSTED, which
README keeps for a full queue), and the server serves on."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from espalier.v1 import espalier_pb2 as pb
from espalier.v1 import espalier_pb2_grpc as pb_grpc
from tests.fixtures.server_process import ServerProcess


@pytest.fixture(scope="module")
def stub() -> Iterator[pb_grpc.EspalierStub]:
    with ServerProcess("--max-message-mb", "1", "--max-prompt-bytes", "1000000") as srv:
        srv.wait_event("tokenizer_loaded")
        with grpc.insecure_channel(srv.address) as channel:
            yield pb_grpc.EspalierStub(channel)


def test_a_reply_past_the_message_limit_is_invalid_argument(stub: pb_grpc.EspalierStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(text="ab" * 300_000), timeout=120)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "over the message limit of 1048576" in str(info.value.details())
    small = stub.Tokenize(pb.TokenizeRequest(text="ab" * 1000), timeout=120)
    assert len(small.token_ids) == len(small.tokens) > 0


def test_the_prompt_limit_stated_is_the_one_the_engine_enforces() -> None:
    """A prompt of the model's full context was refused by the engine (it keeps room for one
    generated token) while ModelInfo said the limit was the context: the stated limit is capped
    at the context less one once the model is known."""
    from espalier.server.config import ServerConfig
    from espalier.server.state import ModelFacts, ServingState

    state = ServingState(ServerConfig(max_prompt_tokens=8192))
    assert state.max_prompt_tokens() == 8192  # no model yet
    state.facts = ModelFacts(max_context_tokens=8192)
    assert state.max_prompt_tokens() == 8191
    state.facts = ModelFacts(max_context_tokens=1 << 20)
    assert state.max_prompt_tokens() == 8192
