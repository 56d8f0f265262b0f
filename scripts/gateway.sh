#!/usr/bin/env bash
# The OpenAI API over espalier: N `espalier serve` replicas (SMG's worker protocol, each on its own
# loopback port) with the SMG gateway in front of them, all on 127.0.0.1. Prints one JSON line
#   {"openai_base_url": "http://127.0.0.1:PORT/v1", "replicas": [{"pid": .., "smg_port": ..,
#    "metrics_port": ..}, ...]}
# when SMG and every replica are ready, then runs until SIGTERM/SIGINT and stops them all.
#
# Usage: scripts/gateway.sh [--replicas N] [--gateway-port N] [espalier serve flags...]
#   (default model: the embedded Gemma 3 270M; e.g. `--model tiny-random` for a fast check)
#
# Routing (SMG): the cache_aware policy (prompt-prefix affinity, least-loaded fallback). A request
# that carries an `X-SMG-Routing-Key` header (e.g. a hash of its response_format) goes where its
# key went before (a new key: the least-loaded replica), so the replica that compiled a grammar
# gets that grammar's later requests; concurrent requests of one key may spread (SMG's choice).
# A replica that dies: its streams end with an error at the client; SMG's health checks (every
# second) take it out of routing; this script restarts it on the same ports and SMG routes to it
# again once its health check passes. SMG exiting stops everything (exit status 1).
# Logs: espalier's and SMG's stderr go to this script's stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SMG=${SMG:-.venv/bin/smg}
START_TIMEOUT_S=${START_TIMEOUT_S:-900}

replicas=1
gateway_port=0
serve_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --replicas) replicas=$2; shift 2 ;;
    --gateway-port) gateway_port=$2; shift 2 ;;
    --port | --smg-port | --metrics-port | --port=* | --smg-port=* | --metrics-port=*)
      echo "gateway.sh: $1 is chosen per replica by this script (see the JSON line)" >&2
      exit 2 ;;
    *) serve_args+=("$1"); shift ;;
  esac
done
case "$replicas" in
  '' | *[!0-9]* | 0) echo "gateway.sh: --replicas must be a positive integer" >&2; exit 2 ;;
esac
free_port() {
  "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
[ "$gateway_port" = 0 ] && gateway_port=$(free_port)
metrics_port=$(free_port)

work=$(mktemp -d)
supervisor_pids=()
smg_pid=""
stop_all() {
  # SIGTERM SMG and every supervisor (each drains its espalier), then wait for them all.
  [ -n "$smg_pid" ] && kill -TERM "$smg_pid" 2>/dev/null || true
  for pid in "${supervisor_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap stop_all EXIT
trap 'exit 0' TERM INT

event_field() {  # event_field FILE EVENT FIELD: FIELD of the first EVENT line espalier printed
  "$PY" -c 'import json, sys
for line in open(sys.argv[1]):
    try:
        e = json.loads(line)
    except ValueError:
        continue
    if e.get("event") == sys.argv[2]:
        print(e.get(sys.argv[3], ""))
        break' "$1" "$2" "$3"
}

supervise() {  # supervise I: run replica I, restarting it on the ports of its first start
  local i=$1 child="" code ports=(--port 0 --smg-port 0 --metrics-port 0)
  trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null; wait "$child" 2>/dev/null; exit 0' TERM
  while :; do
    "$PY" -m espalier.server.main serve "${ports[@]}" "${serve_args[@]}" >"$work/events.$i" &
    child=$!
    echo "$child" >"$work/pid.$i.tmp" && mv "$work/pid.$i.tmp" "$work/pid.$i"
    code=0
    wait "$child" || code=$?
    if grep -q '"event": "listening"' "$work/events.$i"; then
      ports=(--port "$(event_field "$work/events.$i" listening port)"
        --smg-port "$(event_field "$work/events.$i" listening smg_port)"
        --metrics-port "$(event_field "$work/events.$i" listening metrics_port)")
    fi
    if grep -q '"event": "load_failed"' "$work/events.$i"; then
      # A model that cannot load will not load on a restart either.
      echo "gateway.sh: replica $i failed to load: $(event_field "$work/events.$i" load_failed error)" >&2
      exit 1
    fi
    echo "gateway.sh: replica $i exited with status $code; restarting it" >&2
    sleep 1
  done
}

for i in $(seq 1 "$replicas"); do
  : >"$work/events.$i"
  supervise "$i" &
  supervisor_pids+=($!)
done
deadline=$((SECONDS + START_TIMEOUT_S))
worker_urls=()
replica_json=()
for i in $(seq 1 "$replicas"); do
  until grep -q '"event": "serving"' "$work/events.$i"; do
    if ! kill -0 "${supervisor_pids[$((i - 1))]}" 2>/dev/null \
      || grep -q '"event": "load_failed"' "$work/events.$i"; then
      echo "gateway.sh: replica $i did not start (its log is above)" >&2
      exit 1
    fi
    [ $SECONDS -lt $deadline ] || { echo "gateway.sh: espalier serve not ready" >&2; exit 1; }
    sleep 0.5
  done
  port=$(event_field "$work/events.$i" listening smg_port)
  worker_urls+=("grpc://127.0.0.1:$port")
  replica_json+=("{\"pid\": $(cat "$work/pid.$i"), \"smg_port\": $port, \"metrics_port\": \
$(event_field "$work/events.$i" listening metrics_port)}")
done

# The tokenizer (with its chat template) comes from the workers' GetTokenizer. A new routing key
# goes to the replica with the fewest requests in flight (the default, delegating to cache_aware,
# put every key of a shared prompt prefix on one replica); loads polled every second. Health checks
# every second, one failure takes a replica out and one success brings it back; the circuit
# breaker opens after 3 failed requests and probes again after 5 s.
NO_COLOR=1 "$SMG" launch --host 127.0.0.1 --port "$gateway_port" \
  --worker-urls "${worker_urls[@]}" --backend vllm \
  --policy cache_aware --routing-key-override --assignment-mode min_load \
  --load-monitor-interval 1 \
  --health-check-interval-secs 1 --health-check-timeout-secs 2 \
  --health-failure-threshold 1 --health-success-threshold 1 \
  --cb-failure-threshold 3 --cb-success-threshold 1 --cb-timeout-duration-secs 5 \
  --prometheus-host 127.0.0.1 --prometheus-port "$metrics_port" >&2 &
smg_pid=$!
until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$gateway_port/readiness")" = 200 ]; do
  kill -0 "$smg_pid" 2>/dev/null || { echo "gateway.sh: smg exited" >&2; exit 1; }
  [ $SECONDS -lt $deadline ] || { echo "gateway.sh: smg not ready" >&2; exit 1; }
  sleep 0.5
done
joined=""
for entry in "${replica_json[@]}"; do joined="${joined:+$joined, }$entry"; done
echo "{\"openai_base_url\": \"http://127.0.0.1:$gateway_port/v1\", \"replicas\": [$joined]}"
wait "$smg_pid" || true
smg_pid=""
echo "gateway.sh: smg exited; stopping" >&2
exit 1
