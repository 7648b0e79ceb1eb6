#!/usr/bin/env bash
# N prefixd daemons on this machine and Shepherd Model Gateway (smg) in front of them, routing cache-aware.
#
#   contrib/router/serve_many.sh MODEL_DIR [NUM_DAEMONS]        (default 2)
#
# Clients talk to the router (http://127.0.0.1:$ROUTER_PORT/v1, OpenAI's API; the model is the directory's
# name) with the fleet's token as their API key: $STATE_DIR/http-token. Ctrl-C stops everything.
#
# Environment:
#   GPUS="0 1 2 3"        one daemon per GPU (CUDA_VISIBLE_DEVICES); NUM_DAEMONS defaults to their count
#   ROUTER_PORT=30000     the router's port; the daemons take BASE_PORT, BASE_PORT+1, ...
#   BASE_PORT=30100
#   HOST=127.0.0.1        where the router listens (another address needs the token anyway)
#   CACHE_BYTES=          each daemon's --cache-bytes (default: prefixd's)
#   TENANT_KEYS=1         route by the client's x-smg-routing-key header instead of the request text: a new key
#                         (a tenant, a user) goes to the daemon with the fewest keys in flight and stays there; a
#                         request without the header goes to a daemon drawn at random (smg --policy manual)
#   DISK_CACHE_BYTES=8G   each daemon's disk cache: a daemon that restarts comes back warm (0: off)
#   STATE_DIR=~/.local/state/prefixd-fleet   sockets, disk caches, logs, the token
#   PREFIXD=prefixd SMG=smg                  the commands (pip install prefixd's test extra, or pip install smg)
#
# The router flags are those of bench/router_fleet.py (router_command), which the benchmark and the tests run.
# Daemons on other machines: start each with `prefixd serve --http 0.0.0.0:PORT --http-token-file FILE`, then
# run the `"$SMG" launch` line below with their URLs (docs/scaling.md, "Many daemons behind a router").
set -euo pipefail

model=${1:?usage: serve_many.sh MODEL_DIR [NUM_DAEMONS]}
read -r -a gpus <<<"${GPUS:-}"
num=${2:-$(( ${#gpus[@]} > 0 ? ${#gpus[@]} : 2 ))}
router_port=${ROUTER_PORT:-30000}
base_port=${BASE_PORT:-30100}
host=${HOST:-127.0.0.1}
state=${STATE_DIR:-$HOME/.local/state/prefixd-fleet}
prefixd=${PREFIXD:-prefixd}
smg=${SMG:-smg}

mkdir -p "$state"
token_file=$state/http-token
if [ ! -s "$token_file" ]; then
  (umask 077 && head -c 24 /dev/urandom | base64 | tr '+/' '-_' >"$token_file")
fi
token=$(head -n 1 "$token_file")

pids=()
stop_all() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop_all EXIT INT TERM

urls=()
for ((i = 0; i < num; i++)); do
  port=$((base_port + i))
  dir=$state/daemon$i
  mkdir -p "$dir"
  args=(serve --model "$model" --socket "$dir/prefixd.sock" --http "127.0.0.1:$port" --http-token-file "$token_file"
        --cache-dir "$dir/kv" --disk-cache-bytes "${DISK_CACHE_BYTES:-8G}")
  [ -n "${CACHE_BYTES:-}" ] && args+=(--cache-bytes "$CACHE_BYTES")
  if [ ${#gpus[@]} -gt 0 ]; then
    CUDA_VISIBLE_DEVICES=${gpus[$((i % ${#gpus[@]}))]} "$prefixd" "${args[@]}" >"$dir/daemon.log" 2>&1 &
  else
    "$prefixd" "${args[@]}" >"$dir/daemon.log" 2>&1 &
  fi
  pids+=($!)
  urls+=("http://127.0.0.1:$port")
  echo "daemon $i: pid $!, http://127.0.0.1:$port${gpus[*]:+, GPU ${gpus[$((i % ${#gpus[@]}))]}}, log $dir/daemon.log"
done

for ((i = 0; i < num; i++)); do  # GET /health answers once the model is loaded
  until curl -fs "${urls[$i]}/health" >/dev/null; do
    kill -0 "${pids[$i]}" 2>/dev/null || { echo "daemon $i exited; see $state/daemon$i/daemon.log" >&2; exit 1; }
    sleep 0.5
  done
done

if [ "${TENANT_KEYS:-0}" = 1 ]; then
  policy=(--policy manual --assignment-mode min_group)
else
  policy=(--policy cache_aware)
fi
"$smg" launch --host "$host" --port "$router_port" --worker-urls "${urls[@]}" \
  "${policy[@]}" --load-monitor-interval 1 --api-key="$token" \
  --prometheus-host 127.0.0.1 --prometheus-port $((router_port + 1)) \
  --health-check-interval-secs 5 --cb-timeout-duration-secs 10 --shutdown-grace-period-secs 5 \
  --log-level warn >"$state/smg.log" 2>&1 &
pids+=($!)
echo "router: pid $!, http://$host:$router_port/v1 (model $(basename "$model"), API key in $token_file), log $state/smg.log"
wait -n "${pids[@]}" || true
echo "a process of the fleet exited; stopping the others" >&2
