"""The server configuration: one frozen dataclass, built once by the CLI (the composition root)."""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


@dataclass(frozen=True)
class ServerConfig:
    """Everything the gRPC server needs; the engine and the model have their own configs.

    Ports: 0 binds a free port (tests); ``metrics_port=None`` disables the Prometheus endpoint.
    Limits: ``max_concurrent_requests`` generations run or wait in the engine at once (beyond it a
    call is refused with RESOURCE_EXHAUSTED); ``max_queue`` bounds those still waiting for their
    first token; ``max_message_bytes`` bounds every gRPC message in both directions.
    Admission limits, checked on the raw request before anything parses or tokenizes it:
    ``max_prompt_bytes`` (a text prompt, Tokenize text), ``max_grammar_bytes`` (schema, regex,
    grammar, all choice options together), ``max_stop_bytes`` (each stop string),
    ``max_choices``, ``max_grammar_alternatives`` (``|`` in a Lark / GBNF grammar),
    ``max_schema_depth`` (bracket nesting of a schema's JSON).
    ``admission_threads`` parse, check and tokenize requests off the event loop.
    ``engine_restarts``: deaths of the engine process replaced within ten minutes
    (``server/engine_supervisor.py``); one more fails the server (exit 1); 0: the first does.
    ``engine_stall_timeout_s``: an engine process silent this long is hung: killed, and
    replaced as a dead one (0: never).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    max_concurrent_requests: int = 256
    max_queue: int = 1024
    max_message_bytes: int = 16 * MIB
    max_prompt_tokens: int = 8192
    max_grammar_bytes: int = 1 * MIB
    max_prompt_bytes: int = 1 * MIB
    max_stop_bytes: int = 1024
    max_choices: int = 1024
    max_grammar_alternatives: int = 1024
    max_schema_depth: int = 128
    admission_threads: int = 4
    default_max_tokens: int = 256
    max_max_tokens: int = 8192
    compile_timeout_s: float = 30.0
    shutdown_grace_s: float = 30.0
    engine_restarts: int = 3
    engine_stall_timeout_s: float = 300.0
    auth_token: str | None = None
    tls_cert: str | None = None  # PEM file; TLS is on when both cert and key are set
    tls_key: str | None = None
    reflection: bool = True
    # SMG's worker protocol on a second, unauthenticated port (None: off; 0: a free port).
    smg_host: str = "127.0.0.1"
    smg_port: int | None = None
    # The model's reasoning end marker ("</think>"); requests with after_reasoning start their
    # constraint after it. "": none (after_reasoning is refused).
    reasoning_end: str = ""
    unauthenticated_methods: tuple[str, ...] = field(
        default=("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
    )

    def validate(self) -> list[str]:
        """Problems as messages; empty when the config is usable."""
        problems: list[str] = []
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("--tls-cert and --tls-key go together")
        if self.max_concurrent_requests < 1:
            problems.append("max_concurrent_requests must be >= 1")
        if self.max_queue < 1:
            problems.append("max_queue must be >= 1")
        if self.engine_restarts < 0:
            problems.append("--engine-restarts must be at least 0")
        if self.engine_stall_timeout_s < 0:
            problems.append("--engine-stall-timeout must be at least 0")
        if self.max_message_bytes < 1024:
            problems.append("max_message_bytes must be >= 1024")
        for name in (
            "max_prompt_bytes",
            "max_stop_bytes",
            "max_choices",
            "max_grammar_alternatives",
            "admission_threads",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if not 2 <= self.max_schema_depth <= 512:
            problems.append("max_schema_depth must be in [2, 512]")
        if not 1 <= self.default_max_tokens <= self.max_max_tokens:
            problems.append("default_max_tokens must be in [1, max_max_tokens]")
        if self.auth_token is not None and not self.auth_token:
            problems.append("the auth token must not be empty")
        secured = self.auth_token is not None or self.tls
        if self.smg_port is not None and secured and self.smg_host not in LOOPBACK_HOSTS:
            problems.append(
                "the SMG worker port has no authentication: with --auth-token or TLS, "
                "bind --smg-host to loopback"
            )
        return problems

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None and self.tls_key is not None
