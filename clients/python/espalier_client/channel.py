"""Channel options, auth metadata and retry policy shared by both clients."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

MIB = 1 << 20


@dataclass(frozen=True)
class ChannelSettings:
    """How to reach the server. TLS is on when ``tls`` or ``root_certificates`` is given."""

    address: str
    token: str | None = None
    tls: bool = False
    root_certificates: bytes | None = None
    max_message_bytes: int = 16 * MIB
    timeout_s: float | None = 60.0  # default per-call deadline; None = no deadline
    max_retries: int = 3  # extra attempts after UNAVAILABLE (and only after it)
    retry_backoff_s: float = 0.1

    @property
    def secure(self) -> bool:
        return self.tls or self.root_certificates is not None

    def options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
        ]

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def backoff(self, attempt: int) -> float:
        return min(self.retry_backoff_s * (2**attempt), 2.0)


def is_retryable(error: grpc.RpcError) -> bool:
    """Only UNAVAILABLE is retried: every other status would fail the same way again."""
    code = error.code() if hasattr(error, "code") else None
    return bool(code == grpc.StatusCode.UNAVAILABLE)
