#!/usr/bin/env bash
# Health check of a node started by deploy/entrypoint.sh. Exit 0 when healthy.
#
#   healthcheck.sh                 this node is up (the images' HEALTHCHECK, compose's)
#   healthcheck.sh --deployment    the whole deployment answers (Kubernetes liveness probes)
#
# This node: node 0 serves HTTP, healthy when GET /health_generate answers 200 (not /health: the
# entrypoint makes /health report SGLang's status without generating, for the watchdog, and
# that stays 200 while a rank hangs; /health_generate answers within a second while requests
# run, else it generates one token, and fails a hang after SGLang's 20 s). The other nodes serve
# nothing over HTTP, so for them the check only says whether node 0's rendezvous port
# (MASTER_ADDR:MASTER_PORT, held open by node 0 for the whole run) still accepts connections: a
# node 1 whose node 0 is gone shows as unhealthy before its distributed timeout ends it.
#
# --deployment, from any node: node 0's GET /health_generate, which generates one token through
# every rank of every node, so a hung rank anywhere fails it (after SGLang's own 20 s), as the
# entrypoint's watchdog sees it.
set -euo pipefail

# The variables read here, all documented with deploy/entrypoint.sh's in docs/deploy.md.
FARSKIP_HEALTH_VARS=(NODE_RANK HTTP_PORT MASTER_ADDR MASTER_PORT FARSKIP_PYTHON)

# A parked node (deploy/entrypoint.sh, PARK_ON_ERROR=1) is unhealthy, and says why: Docker keeps
# the output in the container's health log (docker inspect, .State.Health).
parked="${TMPDIR:-/tmp}/farskip-parked"
if [[ -f "$parked" ]]; then
  cat "$parked" >&2
  exit 1
fi

rank="${NODE_RANK:-0}"
http_port="${HTTP_PORT:-30000}"
get() {
  # Python rather than curl: it is in every image, curl is not.
  exec "${FARSKIP_PYTHON:-python3}" - "$1" "$2" <<'PY'
import sys
import urllib.request

url, timeout = sys.argv[1], float(sys.argv[2])
try:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError as e:
    print(f"{url}: {e}", file=sys.stderr)
    sys.exit(1)
PY
}

master() {
  local host="${MASTER_ADDR:?MASTER_ADDR is not set (${FARSKIP_HEALTH_VARS[*]} are read)}"
  host="${host#[}"
  echo "${host%]}"
}

case "${1:-}" in
  --deployment)
    if [[ "$rank" == 0 ]]; then
      host=127.0.0.1
    else
      host="$(master)"
      if [[ "$host" == *:* ]]; then host="[$host]"; fi
    fi
    get "http://$host:$http_port/health_generate" 30
    ;;
  "") ;;
  *)
    echo "usage: healthcheck.sh [--deployment] (reads ${FARSKIP_HEALTH_VARS[*]})" >&2
    exit 2
    ;;
esac

if [[ "$rank" == 0 ]]; then
  get "http://127.0.0.1:$http_port/health_generate" 10
fi

host="$(master)"
port="${MASTER_PORT:-50000}"
# shellcheck disable=SC2016  # $1/$2 are expanded by the inner bash, from the arguments
if ! timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$host" "$port" 2>/dev/null; then
  echo "node 0's rendezvous port $host:$port does not answer" >&2
  exit 1
fi
