"""``espalier serve --tensor-parallel 2`` on CPU (gloo): the server starts its second rank itself,
serves plain and constrained generations with the same tokens as the one-process server, and
when that rank is killed mid-stream the client gets INTERNAL naming the rank, health turns
NOT_SERVING and the server exits 1 instead of hanging (``--engine-restarts 0``: no replacement)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from espalier_client import Client, InternalError

from tests.fixtures.server_helpers import SCHEMA, check_output
from tests.fixtures.server_process import ServerProcess

pytestmark = pytest.mark.model


def test_tensor_parallel_server_generates_then_fails_on_a_dead_rank(
    serving: ServerProcess,
) -> None:
    with Client(serving.address, timeout_s=600.0) as client:
        want = client.generate("Once upon a time", max_tokens=10, ignore_eos=True).token_ids
    srv = ServerProcess(
        "--tensor-parallel", "2", "--compile-timeout", "900", "--engine-restarts", "0"
    )
    try:
        assert srv.wait_loaded(), srv.wait_event("load_failed")
        pids = srv.wait_event("tensor_parallel")["pids"]
        assert len(pids) == 1 and pids[0] != srv.proc.pid
        with Client(srv.address, timeout_s=600.0) as client:
            got = client.generate("Once upon a time", max_tokens=10, ignore_eos=True)
            assert list(got.token_ids) == list(want)
            out = client.generate("A person as JSON:", schema=SCHEMA, max_tokens=48)
            check_output("json_schema", out.text, out.finish_reason)
            json.loads(out.text)
            stream = client.stream("Tell me", max_tokens=8000, ignore_eos=True)
            with pytest.raises(InternalError) as info:
                for i, _chunk in enumerate(stream):
                    if i == 2:
                        os.kill(pids[0], signal.SIGKILL)
        assert "rank 1" in info.value.message
        assert "rank 1" in srv.wait_event("engine_failed")["error"]
        srv.wait_event("stopped", timeout=120)
        assert srv.proc.wait(timeout=120) == 1
    finally:
        srv.discard()  # it failed on purpose: the exit status is checked above
