#!/usr/bin/env bash
# Regenerate the Python code of proto/espalier/v1/espalier.proto (grpcio-tools, deterministic):
#   proto/espalier/v1/espalier_pb2{.py,.pyi,_grpc.py}                  (imports as espalier.v1)
#   clients/python/espalier_client/_proto/espalier_pb2{.py,.pyi,_grpc.py} (imports as espalier_client._proto)
# Usage: scripts/gen_proto.sh [OUTPUT_ROOT]   (OUTPUT_ROOT defaults to the repository root;
# tests/server/test_proto_codegen.py regenerates into a temp dir and compares).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-$ROOT}
PY=${PYTHON:-$ROOT/.venv/bin/python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m grpc_tools.protoc -I proto \
  --python_out="$TMP" --pyi_out="$TMP" --grpc_python_out="$TMP" \
  espalier/v1/espalier.proto

mkdir -p "$OUT/proto/espalier/v1" "$OUT/clients/python/espalier_client/_proto"
for f in espalier_pb2.py espalier_pb2.pyi espalier_pb2_grpc.py; do
  cp "$TMP/espalier/v1/$f" "$OUT/proto/espalier/v1/$f"
  sed -e 's/^from espalier\.v1 import /from espalier_client._proto import /' \
    "$TMP/espalier/v1/$f" > "$OUT/clients/python/espalier_client/_proto/$f"
done
