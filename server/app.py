"""Server assembly: ``create_server`` (bind; no model needed) and ``serve`` (the lifecycle)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from espalier.server.auth import BearerTokenInterceptor
from espalier.server.config import ServerConfig
from espalier.server.decode_guard import add_guarded_servicer
from espalier.server.engine_port import ServingEngine
from espalier.server.service import EspalierServicer
from espalier.server.state import ModelFacts, ServingState, announce
from espalier.v1 import espalier_pb2

Loader = Callable[[ServingState], Awaitable[tuple[ServingEngine, ModelFacts]]]


def create_server(config: ServerConfig, state: ServingState) -> tuple[grpc.aio.Server, int]:
    """A bound (not started) grpc.aio server with the servicer, health and reflection.

    Returns the server and its port (the bound one when ``config.port`` is 0). Must be called
    inside a running event loop.
    """
    problems = config.validate()
    if problems:
        raise ValueError("; ".join(problems))
    interceptors = []
    if config.auth_token is not None:
        interceptors.append(
            BearerTokenInterceptor(config.auth_token, config.unauthenticated_methods)
        )
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    add_guarded_servicer(
        EspalierServicer(state),
        server,
        lambda method: state.metrics.requests.labels(method, "INVALID_ARGUMENT").inc(),
    )
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    if config.reflection:
        names = (
            espalier_pb2.DESCRIPTOR.services_by_name["Espalier"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
    address = f"{config.host}:{config.port}"
    if config.tls:
        assert config.tls_cert is not None and config.tls_key is not None
        credentials = grpc.ssl_server_credentials(
            [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
        )
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    return server, port


async def _maybe_await(value: object) -> None:
    if inspect.isawaitable(value):
        await value


async def shutdown(server: grpc.aio.Server, state: ServingState, grace_s: float) -> None:
    """Graceful: health NOT_SERVING, refuse new generations, let streams finish, stop."""
    await state.begin_drain()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(state.idle.wait(), timeout=grace_s)
    await server.stop(grace=1.0)
    if state.engine is not None:
        await _maybe_await(state.engine.shutdown(drain=False))


async def serve(config: ServerConfig, state: ServingState, loader: Loader | None) -> None:
    """Bind, start, load and warm the model (health SERVING), run until SIGTERM/SIGINT, drain."""
    server, port = create_server(config, state)
    smg_server, smg_port = None, None
    if config.smg_port is not None:
        from espalier.server.smg.server import create_smg_server

        smg_server, smg_port = create_smg_server(config, state)
    await state.init_health()
    await server.start()
    if smg_server is not None:
        await smg_server.start()
    metrics_port = None
    if config.metrics_port is not None:
        _http, metrics_port = state.metrics.serve_http(config.metrics_host, config.metrics_port)
    announce(
        event="listening", host=config.host, port=port, metrics_port=metrics_port, smg_port=smg_port
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load_task = None
    if loader is not None:

        async def load() -> None:
            try:
                engine, facts = await loader(state)
            except Exception as exc:  # stay up NOT_SERVING so the failure is visible
                announce(event="load_failed", error=f"{type(exc).__name__}: {exc}")
                raise
            await state.set_ready(engine, facts)
            announce(event="serving", model=facts.model)

        load_task = asyncio.create_task(load())
    stopped, failed = asyncio.create_task(stop.wait()), asyncio.create_task(state.failed.wait())
    await asyncio.wait((stopped, failed), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    failed.cancel()
    await state.begin_drain()
    announce(event="draining")
    if load_task is not None and not load_task.done():
        load_task.cancel()
    await shutdown(server, state, config.shutdown_grace_s)
    if smg_server is not None:
        await smg_server.stop(grace=1.0)
    announce(event="stopped")
    sys.stdout.flush()
