"""``espalier serve`` on CUDA: a killed engine process is replaced, and its GPU memory with it.

The CPU suite kills and replaces the engine (``test_engine_process.py``); on a GPU the dead
process also holds a CUDA context, the KV cache and captured graphs, which must be released
before the replacement allocates its own, or every restart would add one engine's memory.

On a machine without the embedded model's package, ``ESPALIER_TEST_TOKENIZER`` names a
tokenizer folder for the tiny random model (``bench/gpu_data.sh`` writes one).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from espalier_client import Client, UnavailableError

from tests.fixtures.server_helpers import SCHEMA, check_output
from tests.fixtures.server_process import ServerProcess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_a_killed_engine_on_cuda_is_replaced_and_its_memory_released() -> None:
    tokenizer = os.environ.get("ESPALIER_TEST_TOKENIZER")
    args = ["--device", "cuda", "--kv-blocks", "2048", "--engine-restarts", "1"]
    args += ["--compile-timeout", "600"]
    srv = ServerProcess(*args, *(["--tokenizer", tokenizer] if tokenizer else []))
    try:
        assert srv.wait_loaded(), srv.wait_event("load_failed")
        first = srv.wait_event("engine_process")["pid"]
        with Client(srv.address, timeout_s=600.0) as client:
            out = client.generate("A person as JSON:", schema=SCHEMA, max_tokens=48)
            check_output("json_schema", out.text, out.finish_reason)
            held = _used_bytes()  # this process's context and one engine's

            stream = client.stream("Tell me", max_tokens=4000, ignore_eos=True)
            with pytest.raises(UnavailableError):
                for i, _chunk in enumerate(stream):
                    if i == 2:
                        os.kill(first, signal.SIGKILL)
            restarted = srv.wait_event("engine_restarted")
            assert restarted["pid"] != first

            again = client.generate("A person as JSON:", schema=SCHEMA, max_tokens=48)
            check_output("json_schema", again.text, again.finish_reason)
            assert again.text == out.text  # the same weights (seeded) and greedy decoding
            deadline = time.monotonic() + 60
            while _used_bytes() > 1.1 * held and time.monotonic() < deadline:
                time.sleep(1)  # a driver may release a dead context a moment late
            assert _used_bytes() <= 1.1 * held, (held, _used_bytes())
    finally:
        srv.discard()
