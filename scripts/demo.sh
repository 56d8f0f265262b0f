#!/usr/bin/env bash
# Set up (if needed) and run the main job on a sample: start the gRPC server on the embedded
# default model (Gemma 3 270M), wait until health says SERVING, send one JSON-schema-constrained
# request (scripts/demo_schema.json), print the answer, and stop the server gracefully.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

WORK=$(mktemp -d)
.venv/bin/espalier serve --model default --port 0 --compile-timeout 300 \
  > "$WORK/events" 2> "$WORK/server.log" &
SERVER=$!
cleanup() {
  kill -TERM "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# The server prints one JSON line per phase; the first one carries the port it bound.
for _ in $(seq 600); do
  grep -q '"listening"' "$WORK/events" && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log"; exit 1; }
  sleep 0.5
done
PORT=$(.venv/bin/python -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["port"])' "$WORK/events")
ADDRESS="127.0.0.1:$PORT"
echo "server listening on $ADDRESS; loading the model..."
.venv/bin/python -c 'import sys; from espalier_client import Client; Client(sys.argv[1]).wait_ready(timeout=900); print("health: SERVING")' "$ADDRESS" \
  || { cat "$WORK/server.log"; exit 1; }

PROMPT=$'<start_of_turn>user\nDescribe a cat named Tom as JSON.<end_of_turn>\n<start_of_turn>model\n'
echo "request: schema scripts/demo_schema.json, prompt: Describe a cat named Tom as JSON."
.venv/bin/espalier generate --address "$ADDRESS" --schema scripts/demo_schema.json \
  --backend llguidance --max-tokens 96 "$PROMPT"

kill -TERM "$SERVER"
wait "$SERVER"
echo "server stopped (graceful drain)"
