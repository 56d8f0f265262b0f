"""The checked-in generated code equals a fresh run of scripts/gen_proto.sh (CI check)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED = [
    "proto/espalier/v1/espalier_pb2.py",
    "proto/espalier/v1/espalier_pb2.pyi",
    "proto/espalier/v1/espalier_pb2_grpc.py",
    "clients/python/espalier_client/_proto/espalier_pb2.py",
    "clients/python/espalier_client/_proto/espalier_pb2.pyi",
    "clients/python/espalier_client/_proto/espalier_pb2_grpc.py",
]


def test_generated_code_matches_a_fresh_regeneration(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(REPO / "scripts/gen_proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    stale = [rel for rel in GENERATED if (tmp_path / rel).read_bytes() != (REPO / rel).read_bytes()]
    assert not stale, f"run scripts/gen_proto.sh and commit: {stale} differ from the .proto"


def test_server_and_client_copies_describe_the_same_service() -> None:
    from espalier_client._proto import espalier_pb2 as client_pb

    from espalier.v1 import espalier_pb2 as server_pb

    assert client_pb.DESCRIPTOR.serialized_pb == server_pb.DESCRIPTOR.serialized_pb
    service = server_pb.DESCRIPTOR.services_by_name["Espalier"]
    assert [m.name for m in service.methods] == [
        "Generate",
        "GenerateUnary",
        "CompileGrammar",
        "Tokenize",
        "GetModelInfo",
    ]
    assert service.methods_by_name["Generate"].server_streaming
    constraint = server_pb.Constraint.DESCRIPTOR.oneofs_by_name["kind"]
    assert [f.name for f in constraint.fields] == [
        "json_schema",
        "any_json",
        "regex",
        "ebnf",
        "lark",
        "choice",
        "structural_tag",
    ]


def test_typescript_package_carries_the_same_proto() -> None:
    """clients/typescript builds on its own from its checked-in copy of the contract."""
    copy = REPO / "clients/typescript/proto/espalier/v1/espalier.proto"
    source = REPO / "proto/espalier/v1/espalier.proto"
    assert copy.read_bytes() == source.read_bytes(), f"copy {source} to {copy} and commit"
