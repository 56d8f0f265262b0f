"""The SMG worker port: a second grpc.aio server over the same serving state and engine.

A port of its own because SMG's worker client sends neither a bearer token nor client TLS: the
``espalier.v1`` port keeps its authentication, and this one is for loopback or a private
network (``ServerConfig.validate`` refuses a non-loopback one when the main port is secured).
Admission limits, draining and health are shared with the main port.
"""

from __future__ import annotations

import grpc

from espalier.server.config import ServerConfig
from espalier.server.service import EspalierServicer
from espalier.server.state import ServingState


def create_smg_server(config: ServerConfig, state: ServingState) -> tuple[grpc.aio.Server, int]:
    """A bound (not started) server for ``vllm.grpc.engine.VllmEngine`` on ``config.smg_port``.

    Returns the server and its port (the bound one when ``smg_port`` is 0). Must be called inside
    a running event loop.
    """
    from smg_grpc_proto import vllm_engine_pb2

    from espalier.server.decode_guard import add_guarded_servicer
    from espalier.server.smg.servicer import SmgWorkerServicer

    assert config.smg_port is not None
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    servicer = SmgWorkerServicer(state, EspalierServicer(state))
    add_guarded_servicer(  # undecodable requests: INVALID_ARGUMENT, as on the main port
        servicer,
        server,
        lambda method: state.metrics.requests.labels(method, "INVALID_ARGUMENT").inc(),
        vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"],
    )
    address = f"{config.smg_host}:{config.smg_port}"
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port
