#!/usr/bin/env bash
# Container health check of a node started by deploy/entrypoint.sh (the images' HEALTHCHECK,
# and deploy/compose.yaml's). Exit 0 when healthy.
#
# Node 0 serves HTTP: healthy when GET /health answers 200. The other nodes serve nothing over
# HTTP, so for them the check only says whether node 0's rendezvous port (MASTER_ADDR:
# MASTER_PORT, held open by node 0 for the whole run) still accepts connections: a node 1
# whose node 0 is gone shows as unhealthy before its distributed timeout ends it.
set -euo pipefail

# The variables read here, all documented with deploy/entrypoint.sh's in docs/deploy.md.
FARSKIP_HEALTH_VARS=(NODE_RANK HTTP_PORT MASTER_ADDR MASTER_PORT FARSKIP_PYTHON)

rank="${NODE_RANK:-0}"
if [[ "$rank" == 0 ]]; then
  # Python rather than curl: it is in every image, curl is not.
  exec "${FARSKIP_PYTHON:-python3}" - "${HTTP_PORT:-30000}" <<'PY'
import sys
import urllib.request

url = f"http://127.0.0.1:{sys.argv[1]}/health"
try:
    with urllib.request.urlopen(url, timeout=10) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError as e:
    print(f"{url}: {e}", file=sys.stderr)
    sys.exit(1)
PY
fi

host="${MASTER_ADDR:?MASTER_ADDR is not set (${FARSKIP_HEALTH_VARS[*]} are read)}"
host="${host#[}"
host="${host%]}"
port="${MASTER_PORT:-50000}"
# shellcheck disable=SC2016  # $1/$2 are expanded by the inner bash, from the arguments
if ! timeout 5 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$host" "$port" 2>/dev/null; then
  echo "node 0's rendezvous port $host:$port does not answer" >&2
  exit 1
fi
