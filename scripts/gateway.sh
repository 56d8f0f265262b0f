#!/usr/bin/env bash
# The OpenAI API over espalier: `espalier serve` (SMG's worker protocol on a loopback port) with
# the SMG gateway in front of it, both on 127.0.0.1. Prints one JSON line
#   {"openai_base_url": "http://127.0.0.1:PORT/v1"}
# when both are ready, then runs until SIGTERM/SIGINT and stops both.
#
# Usage: scripts/gateway.sh [--gateway-port N] [espalier serve flags...]
#   (default model: the embedded Gemma 3 270M; e.g. `--model tiny-random` for a fast check)
# Logs: espalier's and SMG's stderr go to this script's stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SMG=${SMG:-.venv/bin/smg}
START_TIMEOUT_S=${START_TIMEOUT_S:-900}

gateway_port=0
serve_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --gateway-port) gateway_port=$2; shift 2 ;;
    *) serve_args+=("$1"); shift ;;
  esac
done
free_port() {
  "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
[ "$gateway_port" = 0 ] && gateway_port=$(free_port)
metrics_port=$(free_port)

work=$(mktemp -d)
espalier_pid=""
smg_pid=""
stop_all() {
  # SIGTERM both (espalier drains its streams), then wait for them.
  [ -n "$smg_pid" ] && kill -TERM "$smg_pid" 2>/dev/null || true
  [ -n "$espalier_pid" ] && kill -TERM "$espalier_pid" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap stop_all EXIT
trap 'exit 0' TERM INT

event_field() {  # event_field EVENT FIELD: FIELD of the first EVENT line espalier printed
  "$PY" -c 'import json, sys
for line in open(sys.argv[1]):
    try:
        e = json.loads(line)
    except ValueError:
        continue
    if e.get("event") == sys.argv[2]:
        print(e.get(sys.argv[3], ""))
        break' "$work/events" "$1" "$2"
}

"$PY" -m espalier.server.main serve --port 0 --smg-port 0 "${serve_args[@]}" >"$work/events" &
espalier_pid=$!
deadline=$((SECONDS + START_TIMEOUT_S))
until grep -q '"event": "serving"' "$work/events"; do
  if ! kill -0 "$espalier_pid" 2>/dev/null || grep -q '"event": "load_failed"' "$work/events"; then
    echo "gateway.sh: espalier serve failed: $(event_field load_failed error)" >&2
    exit 1
  fi
  [ $SECONDS -lt $deadline ] || { echo "gateway.sh: espalier serve not ready" >&2; exit 1; }
  sleep 0.5
done
worker_port=$(event_field listening smg_port)

# The tokenizer (with its chat template) comes from the worker's GetTokenizer.
"$SMG" launch --host 127.0.0.1 --port "$gateway_port" \
  --worker-urls "grpc://127.0.0.1:$worker_port" --backend vllm \
  --prometheus-host 127.0.0.1 --prometheus-port "$metrics_port" >&2 &
smg_pid=$!
until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$gateway_port/readiness")" = 200 ]; do
  kill -0 "$smg_pid" 2>/dev/null || { echo "gateway.sh: smg exited" >&2; exit 1; }
  [ $SECONDS -lt $deadline ] || { echo "gateway.sh: smg not ready" >&2; exit 1; }
  sleep 0.5
done
echo "{\"openai_base_url\": \"http://127.0.0.1:$gateway_port/v1\"}"
wait -n "$espalier_pid" "$smg_pid" || true
echo "gateway.sh: a process exited; stopping" >&2
exit 1
