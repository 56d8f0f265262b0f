"""Typed client for the espalier gRPC service.

from espalier_client import Client
with Client("127.0.0.1:50051") as client:
    person = client.generate_json(Person, "A person: ")   # a validated Person instance
"""

from espalier_client.aio import AsyncClient
from espalier_client.client import Client
from espalier_client.errors import (
    DeadlineExceededError,
    EspalierError,
    FieldViolation,
    InternalError,
    InvalidArgumentError,
    OutputValidationError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from espalier_client.types import Chunk, CompileResult, Generation

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "CompileResult",
    "DeadlineExceededError",
    "EspalierError",
    "FieldViolation",
    "Generation",
    "InternalError",
    "InvalidArgumentError",
    "OutputValidationError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
]
