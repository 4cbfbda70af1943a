#!/usr/bin/env bash
# The one launcher of sglang-farskip on a node, used by every way of deploying it: the
# images' ENTRYPOINT (so docker compose), the Kubernetes LeaderWorkerSet and the Slurm batch
# script. It reads the environment, checks it, sets the network and timeout variables that
# multi-node runs need, and execs `python -m sglang_farskip.launch_server` with EP16/TP16
# DeepSeek-V3 defaults for two nodes, under a watchdog that ends it when the deployment stops
# answering (so that the restart policy brings the node back).
#
#   entrypoint.sh [--check] [SGLang flags...]
#
# --check (or FARSKIP_DRY_RUN=1): validate and print the command, do not start anything.
# Any other argument is passed to SGLang after the generated flags (a repeated flag wins).
# A bad setting prints one `error: ...` line per problem and exits with status 2.
# docs/deploy.md documents every variable this script reads.
set -euo pipefail

# Every variable this script reads from the environment. docs/deploy.md documents each one,
# deploy/node0.env and deploy/node1.env list each one, deploy/compose.yaml passes each one;
# tests/test_deploy_static.py checks all three against this list.
FARSKIP_ENV_VARS=(
  NODE_RANK NNODES MASTER_ADDR WORKER_ADDRS MASTER_PORT
  MODEL_PATH TP_SIZE EP_SIZE FARSKIP_MODE HTTP_HOST HTTP_PORT FARSKIP_ALLOW_NO_API_KEY
  API_KEY API_KEY_FILE ADMIN_API_KEY ADMIN_API_KEY_FILE
  NET_IFNAME GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME NCCL_IB_HCA SGLANG_HOST_IP
  DIST_TIMEOUT NCCL_DEBUG TORCH_NCCL_ASYNC_ERROR_HANDLING GPU_MAX_HW_QUEUES
  WATCHDOG WATCHDOG_INTERVAL WATCHDOG_TIMEOUT WATCHDOG_FAILURES WATCHDOG_START_TIMEOUT
  WATCHDOG_RESTARTS WATCHDOG_BACKOFF PARK_ON_ERROR
  PD_ROLE BOOTSTRAP_PORT MC_MIN_RPC_PORT MC_MAX_RPC_PORT
  EXTRA_ARGS FARSKIP_PLATFORM FARSKIP_PYTHON FARSKIP_DRY_RUN
)

usage() {
  sed -n '2,13s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
  echo "Variables read: ${FARSKIP_ENV_VARS[*]}"
}

dry_run="${FARSKIP_DRY_RUN:-0}"
parked_child=0
case "${1:-}" in
  --check) dry_run=1; shift ;;
  -h | --help) usage; exit 0 ;;
  # The parking parent's own child (below); not for users.
  --parked-child) parked_child=1; shift ;;
esac

# ---------------------------------------------------------------- parking (compose)
# PARK_ON_ERROR=1 (deploy/compose.yaml sets it): this script runs itself as a child and waits;
# when that child ends with 2 (a refused setting) or 71 (the watchdog gave up), it parks: the
# container stays up doing nothing, its health check fails with the child's `error:` lines
# (parked_file, read by deploy/healthcheck.sh), and the log says so. Why: compose restarts a
# container that dies (`restart: unless-stopped`: killed from the host, the engine restarted,
# the host rebooted), and no Docker policy can leave out an exit status, so a container that
# exited 2 or 71 would be started again forever; a parked one is never restarted, because it
# never exits. `docker stop` ends it with the child's status. Any other status is this
# container's own (Docker restarts it). Kubernetes and Slurm keep PARK_ON_ERROR=0: their
# supervisors see the status itself (docs/deploy.md, "Self-healing").
: "${PARK_ON_ERROR:=0}"
parked_file="${TMPDIR:-/tmp}/farskip-parked"
if [[ "$PARK_ON_ERROR" == 1 && "$dry_run" != 1 && "$parked_child" == 0 ]]; then
  rm -f "$parked_file" # a container that Docker restarts keeps its files
  errors="$(mktemp)"
  # The child's stderr goes on to the log as it comes; its `error:` lines are also kept.
  exec {log_fd}> >(while IFS= read -r line; do
    printf '%s\n' "$line" >&2
    if [[ "$line" == error:* ]]; then printf '%s\n' "$line" >>"$errors"; fi
  done)
  log_reader=$!
  "${BASH_SOURCE[0]}" --parked-child "$@" 2>&"$log_fd" &
  child=$!
  # docker stop: SIGTERM reaches this process (Docker's init forwards it), the server must get it.
  stopping=0
  trap 'stopping=1; kill -TERM "$child" 2>/dev/null || true' TERM INT
  while :; do
    status=0
    wait "$child" || status=$?
    if ! kill -0 "$child" 2>/dev/null; then break; fi # else a signal woke the wait
  done
  trap - TERM INT
  exec {log_fd}>&-
  wait "$log_reader" 2>/dev/null || true
  # Told to stop: stopped, whatever the status.
  if [[ "$stopping" == 1 || ("$status" != 2 && "$status" != 71) ]]; then exit "$status"; fi
  case "$status" in
    2) why="a setting was refused" ;;
    71) why="the watchdog gave up after WATCHDOG_RESTARTS failed starts" ;;
  esac
  { echo "parked: exit status $status, $why:"; cat "$errors"; } >"$parked_file"
  rm -f "$errors"
  echo "error: parked: the server stopped with status $status ($why; the error: line above says why); the container stays up and unhealthy so that Docker does not start it again; fix the cause, then docker compose up -d --force-recreate" >&2
  sleeper=""
  trap 'if [[ -n "$sleeper" ]]; then kill "$sleeper" 2>/dev/null || true; fi; exit "$status"' TERM INT
  while :; do
    sleep 3600 &
    sleeper=$!
    wait "$sleeper" || true
  done
fi

# ---------------------------------------------------------------- defaults
# Literal defaults, one per line in this form: the tests compare them with the env files and
# the docs. An empty value counts as unset (compose passes unset variables as empty).
: "${NNODES:=2}"
: "${MASTER_PORT:=50000}"
: "${TP_SIZE:=16}"
: "${EP_SIZE:=16}"
: "${FARSKIP_MODE:=overlap}"
: "${HTTP_HOST:=0.0.0.0}"
: "${HTTP_PORT:=30000}"
# Anyone who reaches HTTP_PORT can use the API unless a key is set; see the check below.
: "${FARSKIP_ALLOW_NO_API_KEY:=0}"
# Bounds every collective, including the rendezvous and SGLang's own gloo CPU groups (which
# upstream leaves at 2 h; sglang_farskip/serve/timeouts.py): a peer that never arrives, dies or loses
# its link makes the other node fail after about this long instead of hanging (torch's own
# defaults: 10 min for NCCL, 30 min for gloo). Not shorter, because it must also cover the
# start-up skew between the nodes: node 1 started by hand after node 0, and first-use kernel
# compilation (Triton, AITER on ROCm) that takes minutes on a node whose cache is cold.
# (Weight loading is not the limit: SGLang waits up to 480 s for a slow node after loading.)
: "${DIST_TIMEOUT:=300}"
# NCCL/RCCL print nothing on failure at their default level; WARN names the failing peer.
: "${NCCL_DEBUG:=WARN}"
# On a collective timeout the NCCL watchdog aborts the communicators and ends the process, so a
# dead peer makes this node exit too. (TORCH_NCCL_BLOCKING_WAIT is deliberately not set: it
# makes each wait() hold the CPU until the collective ends, which stalls the kernel launches
# FarSkip queues behind its overlapped communication, and it cannot be graph-captured.)
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"
# ROCm: HIP maps streams onto this many hardware queues (4 by default); with 8 FarSkip's
# side-stream all-reduce gets a queue of its own instead of waiting behind compute.
: "${GPU_MAX_HW_QUEUES:=8}"
: "${FARSKIP_PYTHON:=python3}"
# The watchdog (python/sglang_farskip/serve/watchdog.py) checks node 0's /health_generate from every
# node, once the server has answered the first time, and ends the server after
# WATCHDOG_FAILURES failed checks in a row: a hung rank on either node then restarts both
# nodes instead of leaving them up and useless. Detection takes up to about
# WATCHDOG_FAILURES * (WATCHDOG_INTERVAL + WATCHDOG_TIMEOUT) seconds; a check of a hung
# deployment takes 20 s (SGLang's own health-check timeout), so the default is ~1.5-2 min.
: "${WATCHDOG:=1}"
: "${WATCHDOG_INTERVAL:=10}"
: "${WATCHDOG_TIMEOUT:=30}"
: "${WATCHDOG_FAILURES:=3}"
# A start that never answers (stuck loading weights or capturing graphs) is ended after this:
# above the 40 min DeepSeek-V3 may take to load (the Kubernetes startup probes allow as much).
: "${WATCHDOG_START_TIMEOUT:=3600}"
# Prefill/decode disaggregation (docs/pd.md): this server's role, SGLang's --disaggregation-mode
# (none: a whole server). A prefill server listens for decode servers on BOOTSTRAP_PORT (SGLang's
# default, written out because the router's env names the same port; deploy/router.py).
: "${PD_ROLE:=none}"
: "${BOOTSTRAP_PORT:=8998}"
: "${GLOO_SOCKET_IFNAME:=${NET_IFNAME:-}}"
: "${NCCL_SOCKET_IFNAME:=${NET_IFNAME:-}}"

errors=()
err() { errors+=("$*"); }

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
is_port() { is_uint "$1" && ((10#$1 >= 1 && 10#$1 <= 65535)); }
interfaces() {
  local path names=()
  for path in /sys/class/net/*; do names+=("${path##*/}"); done
  echo "${names[*]}"
}

# ---------------------------------------------------------------- checks
for var in NNODES TP_SIZE EP_SIZE DIST_TIMEOUT WATCHDOG_INTERVAL WATCHDOG_TIMEOUT WATCHDOG_FAILURES WATCHDOG_START_TIMEOUT; do
  value="${!var}"
  if ! is_uint "$value" || ((10#$value < 1)); then
    err "$var=$value is not a positive integer: set $var to a whole number such as 16"
  fi
done
for var in MASTER_PORT HTTP_PORT BOOTSTRAP_PORT; do
  if ! is_port "${!var}"; then
    err "$var=${!var} is not a TCP port: set $var to a number from 1 to 65535"
  fi
done

case "$PD_ROLE" in
  none | prefill | decode) ;;
  *) err "PD_ROLE=$PD_ROLE is not a role: set PD_ROLE=prefill or decode for prefill/decode disaggregation, or none" ;;
esac
if [[ "$PD_ROLE" == prefill ]] && is_port "$BOOTSTRAP_PORT"; then
  for var in HTTP_PORT MASTER_PORT; do
    if is_port "${!var}" && ((10#${!var} == 10#$BOOTSTRAP_PORT)); then
      err "BOOTSTRAP_PORT and $var are both $BOOTSTRAP_PORT: a prefill server listens on both, give them different values"
    fi
  done
fi
# Mooncake's listeners (KV transfer in PD): unset, Mooncake picks random ports (15000-17000 seen);
# set, they stay in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, which a firewall can then admit.
if [[ -n "${MC_MIN_RPC_PORT:-}${MC_MAX_RPC_PORT:-}" ]]; then
  if ! is_port "${MC_MIN_RPC_PORT:-}" || ! is_port "${MC_MAX_RPC_PORT:-}"; then
    err "MC_MIN_RPC_PORT=${MC_MIN_RPC_PORT:-} MC_MAX_RPC_PORT=${MC_MAX_RPC_PORT:-}: set both to TCP ports (Mooncake's range, e.g. 15000 and 15999), or neither"
  elif ((10#$MC_MIN_RPC_PORT > 10#$MC_MAX_RPC_PORT)); then
    err "MC_MIN_RPC_PORT=$MC_MIN_RPC_PORT is above MC_MAX_RPC_PORT=$MC_MAX_RPC_PORT: set the range's low end first"
  fi
fi

if [[ -z "${NODE_RANK:-}" ]]; then
  err "NODE_RANK is not set: set NODE_RANK=0 on the node that serves HTTP and NODE_RANK=1 on the other"
elif ! is_uint "$NODE_RANK"; then
  err "NODE_RANK=$NODE_RANK is not a non-negative integer: set NODE_RANK=0 on the first node, 1 on the second"
elif is_uint "$NNODES" && ((10#$NODE_RANK >= 10#$NNODES)); then
  err "NODE_RANK=$NODE_RANK is not below NNODES=$NNODES: set NODE_RANK to 0 .. $((10#$NNODES - 1)), one value per node"
fi

if is_uint "$TP_SIZE" && is_uint "$NNODES" && ((10#$NNODES >= 1)); then
  if ((10#$TP_SIZE % 10#$NNODES != 0)); then
    err "TP_SIZE=$TP_SIZE is not divisible by NNODES=$NNODES: each node runs TP_SIZE/NNODES GPUs, so use e.g. TP_SIZE=16 for 2 nodes of 8 GPUs"
  fi
fi
if is_uint "$TP_SIZE" && is_uint "$EP_SIZE" && ((10#$EP_SIZE >= 1)); then
  if ((10#$TP_SIZE % 10#$EP_SIZE != 0)); then
    err "EP_SIZE=$EP_SIZE does not divide TP_SIZE=$TP_SIZE: SGLang splits the TP ranks into expert groups, so set EP_SIZE to TP_SIZE (16) or a divisor of it"
  fi
fi

case "$dry_run" in
  0 | 1) ;;
  *) err "FARSKIP_DRY_RUN=$dry_run is not 0 or 1: set FARSKIP_DRY_RUN=1 to print the command without starting" ;;
esac

case "$PARK_ON_ERROR" in
  0 | 1) ;;
  *) err "PARK_ON_ERROR=$PARK_ON_ERROR is not 0 or 1: set it to 1 only under a restart policy that restarts every exit (compose's unless-stopped)" ;;
esac

case "$WATCHDOG" in
  0 | 1) ;;
  *) err "WATCHDOG=$WATCHDOG is not 0 or 1: set WATCHDOG=0 only where something else restarts a hung server" ;;
esac

case "$FARSKIP_ALLOW_NO_API_KEY" in
  0 | 1) ;;
  *) err "FARSKIP_ALLOW_NO_API_KEY=$FARSKIP_ALLOW_NO_API_KEY is not 0 or 1: set it to 1 only to serve without API_KEY beyond loopback" ;;
esac
# An open API on a GPU node's network is an open door: beyond loopback, a key or an explicit yes.
case "$HTTP_HOST" in
  127.* | ::1 | localhost) loopback=1 ;;
  *) loopback=0 ;;
esac
# The keys: KEY or KEY_FILE (Docker and Kubernetes secrets are files; a file keeps the key out
# of `docker inspect` and the pod spec). Only node 0 serves the API, so only node 0 takes them.
# How long a key must be, and that the two differ, the launcher checks (one place).
read_key() { # read_key NAME VALUE FILE: sets key_NAME from VALUE, or from the file FILE
  local name=$1 value=$2 file=$3
  if [[ -n "$value" && -n "$file" ]]; then
    key_unreadable=1
    err "$name and ${name}_FILE are both set: keep one (the file, for a Docker or Kubernetes secret)"
  elif [[ -n "$file" ]]; then
    value=""
    if [[ ! -f "$file" || ! -r "$file" ]]; then
      key_unreadable=1
      err "${name}_FILE=$file is not a readable file: mount the secret there, or unset ${name}_FILE"
    else
      value="$(<"$file")" # without the trailing newline
      if [[ -z "$value" ]]; then key_unreadable=1 && err "${name}_FILE=$file is empty: write the key into it"; fi
    fi
  fi
  printf -v "key_$name" '%s' "$value"
}
# deploy/compose.yaml hands API_KEY and ADMIN_API_KEY over as files, not variables (a variable
# would stay in docker-init's environment): a file there is the variable's value.
compose_key() { # compose_key NAME: the value compose wrote for NAME, or nothing
  local file="/run/secrets/farskip_$1"
  if [[ -f "$file" ]]; then printf '%s' "$(<"$file")"; fi
}
key_API_KEY="" key_ADMIN_API_KEY="" key_unreadable=0 node0=0
if is_uint "${NODE_RANK:-}" && ((10#$NODE_RANK == 0)); then node0=1; fi
if ((node0)); then
  read_key API_KEY "${API_KEY:-$(compose_key API_KEY)}" "${API_KEY_FILE:-}"
  read_key ADMIN_API_KEY "${ADMIN_API_KEY:-$(compose_key ADMIN_API_KEY)}" "${ADMIN_API_KEY_FILE:-}"
fi
if ((node0 && loopback == 0 && !key_unreadable)) && [[ -z "$key_API_KEY" && "$FARSKIP_ALLOW_NO_API_KEY" != 1 ]]; then
  err "API_KEY is not set and the API would listen on HTTP_HOST=$HTTP_HOST: set API_KEY or API_KEY_FILE (clients send 'Authorization: Bearer <key>'), or set FARSKIP_ALLOW_NO_API_KEY=1 to serve without a key, or HTTP_HOST=127.0.0.1"
fi
case " ${EXTRA_ARGS:-} " in
  *" --api-k"* | *" --admin-api-k"* | *" --admin-a"*)
    err "EXTRA_ARGS holds an API key flag, which shows on the command line: set API_KEY/ADMIN_API_KEY (or their _FILE) instead" ;;
esac

if [[ -z "${MODEL_PATH:-}" ]]; then
  err "MODEL_PATH is not set: set it to the checkpoint directory as seen inside the container (e.g. /models/DeepSeek-V3-FarSkip), or to 'demo' for the built-in tiny model"
elif [[ "$MODEL_PATH" != demo ]]; then
  if [[ ! -d "$MODEL_PATH" ]]; then
    err "MODEL_PATH=$MODEL_PATH is not a directory on this node: mount the checkpoint (MODEL_DIR in deploy/nodeN.env) and give its path inside the container"
  elif [[ ! -f "$MODEL_PATH/config.json" ]]; then
    err "MODEL_PATH=$MODEL_PATH has no config.json: point MODEL_PATH at the Hugging Face checkpoint directory itself"
  fi
fi

if [[ -z "${FARSKIP_PLATFORM:-}" ]]; then
  # The images set this; elsewhere, guess from the device files the drivers create.
  if [[ -e /dev/kfd ]]; then
    FARSKIP_PLATFORM=rocm
  elif [[ -e /dev/nvidiactl ]]; then
    FARSKIP_PLATFORM=cuda
  else
    FARSKIP_PLATFORM=cpu
  fi
fi
case "$FARSKIP_PLATFORM" in
  rocm | cuda | cpu) ;;
  *) err "FARSKIP_PLATFORM=$FARSKIP_PLATFORM is not a platform: use rocm, cuda or cpu (or leave it unset)" ;;
esac

if ! command -v "$FARSKIP_PYTHON" >/dev/null 2>&1; then
  err "FARSKIP_PYTHON=$FARSKIP_PYTHON is not an executable on PATH: set it to the Python that has sglang_farskip installed"
# The modes are the launcher's own list (config.FarSkipMode, its --farskip-mode choices), asked
# for rather than copied here: a copy drifted once (it lacked `blocking`). config.py is pure
# Python, so this costs a bare interpreter start.
elif ! modes="$("$FARSKIP_PYTHON" -c 'from sglang_farskip.config import FarSkipMode; print(*(m.value for m in FarSkipMode))' 2>/dev/null)"; then
  err "FARSKIP_PYTHON=$FARSKIP_PYTHON cannot import sglang_farskip: set it to the Python that has sglang_farskip installed"
elif [[ " $modes " != *" $FARSKIP_MODE "* || "$FARSKIP_MODE" == *" "* ]]; then
  err "FARSKIP_MODE=$FARSKIP_MODE is not a FarSkip mode: use one of ${modes// /, }"
fi

multinode=0
if is_uint "$NNODES" && ((10#$NNODES > 1)); then
  multinode=1
fi

# An interface list in NCCL's syntax: "a,b" matches names starting with a or b, "=a" matches
# exactly, "^a" excludes (nothing to check then).
check_nccl_ifname() {
  local var="$1" value="${!1}" item name found exact=0 items=()
  [[ -z "$value" || "$value" == ^* ]] && return 0
  if [[ "$value" == =* ]]; then exact=1; value="${value#=}"; fi
  IFS=',' read -ra items <<<"$value"
  for item in "${items[@]}"; do
    found=0
    for name in /sys/class/net/*; do
      name="${name##*/}"
      if [[ "$name" == "$item" ]] || { ((exact == 0)) && [[ "$name" == "$item"* ]]; }; then
        found=1
      fi
    done
    if ((found == 0)); then
      err "$var=${!var}: no network interface matches '$item' on this node (interfaces: $(interfaces)); set $var or NET_IFNAME to the interface that carries node-to-node traffic"
    fi
  done
}

if ((multinode)); then
  if [[ -z "${MASTER_ADDR:-}" ]]; then
    err "MASTER_ADDR is not set: set it to node 0's address on the cluster network, the same value on every node"
  else
    colons="${MASTER_ADDR//[^:]/}"
    if [[ ${#colons} -eq 1 || "$MASTER_ADDR" == \[*\]:* ]]; then
      err "MASTER_ADDR=$MASTER_ADDR includes a port: set MASTER_ADDR to the host alone and MASTER_PORT to the port"
    elif [[ ! "$MASTER_ADDR" =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]] &&
      [[ ! "$MASTER_ADDR" =~ ^\[?[0-9A-Fa-f:.]+\]?$ ]]; then
      err "MASTER_ADDR=$MASTER_ADDR is not a host name or IP address: set it to node 0's address, e.g. 10.0.0.1"
    fi
  fi
  if [[ -z "${NET_IFNAME:-}" ]]; then
    err "NET_IFNAME is not set: set it to the network interface that carries node-to-node traffic (interfaces on this node: $(interfaces))"
  fi
  if is_port "$MASTER_PORT" && is_port "$HTTP_PORT" && ((10#$MASTER_PORT == 10#$HTTP_PORT)); then
    err "MASTER_PORT and HTTP_PORT are both $HTTP_PORT: node 0 listens on both, give them different values"
  fi
fi

# Interface names are checked whenever they are set: a wrong one is the classic reason for
# rank 1 never arriving, or for NCCL silently picking a slow or unreachable network.
if [[ -n "${NET_IFNAME:-}" && ! -e "/sys/class/net/$NET_IFNAME" ]]; then
  err "NET_IFNAME=$NET_IFNAME is not a network interface on this node (interfaces: $(interfaces)); with host networking use the host's interface name, e.g. from 'ip -br addr'"
fi
# gloo takes a comma-separated list of exact names. (A value that is NET_IFNAME's was checked.)
if [[ -n "$GLOO_SOCKET_IFNAME" && "$GLOO_SOCKET_IFNAME" != "${NET_IFNAME:-}" ]]; then
  IFS=',' read -ra gloo_names <<<"$GLOO_SOCKET_IFNAME"
  for name in "${gloo_names[@]}"; do
    if [[ ! -e "/sys/class/net/$name" ]]; then
      err "GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME: '$name' is not a network interface on this node (interfaces: $(interfaces)); unset it to use NET_IFNAME"
    fi
  done
fi
if [[ "$NCCL_SOCKET_IFNAME" != "${NET_IFNAME:-}" ]]; then
  check_nccl_ifname NCCL_SOCKET_IFNAME
fi
if [[ -n "${NCCL_IB_HCA:-}" && "$NCCL_IB_HCA" != ^* ]]; then
  if ! compgen -G "/sys/class/infiniband/*" >/dev/null; then
    err "NCCL_IB_HCA=$NCCL_IB_HCA but no InfiniBand/RoCE device is visible here (/sys/class/infiniband is empty): pass /dev/infiniband into the container (deploy/compose.rdma.yaml) or unset NCCL_IB_HCA"
  else
    IFS=',' read -ra hcas <<<"${NCCL_IB_HCA#=}"
    for hca in "${hcas[@]}"; do
      hca="${hca%%:*}"
      if ! compgen -G "/sys/class/infiniband/${hca}*" >/dev/null; then
        err "NCCL_IB_HCA=$NCCL_IB_HCA: no device matches '$hca' on this node; fix or unset NCCL_IB_HCA"
      fi
    done
  fi
fi

if ((${#errors[@]})); then
  printf 'error: %s\n' "${errors[@]}" >&2
  exit 2
fi

# ---------------------------------------------------------------- network environment
if ((multinode)); then
  if [[ "$NET_IFNAME" == lo ]]; then
    echo "warning: NET_IFNAME=lo only works when every node runs on this one machine" >&2
  fi
  # The node's own address: SGLang advertises it to the other node (its guess can pick an
  # address the peer cannot reach, e.g. a docker bridge).
  if [[ -z "${SGLANG_HOST_IP:-}" ]]; then
    if ! SGLANG_HOST_IP="$("$FARSKIP_PYTHON" - "$NET_IFNAME" <<'PY'
import fcntl, socket, struct, sys

SIOCGIFADDR = 0x8915  # Linux: the interface's IPv4 address
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    req = struct.pack("256s", sys.argv[1].encode()[:15])
    print(socket.inet_ntoa(fcntl.ioctl(sock.fileno(), SIOCGIFADDR, req)[20:24]))
except OSError:
    sys.exit(1)
PY
    )"; then
      echo "error: NET_IFNAME=$NET_IFNAME has no IPv4 address: set SGLANG_HOST_IP to this node's address on the cluster network" >&2
      exit 2
    fi
  fi
  # A typo in MASTER_ADDR otherwise shows up as rank 1 waiting DIST_TIMEOUT for nothing.
  # Kubernetes publishes the leader's DNS name a little after the pod starts: retry a while.
  resolve_deadline=$((SECONDS + (dry_run == 1 ? 0 : 10#$DIST_TIMEOUT)))
  host="${MASTER_ADDR#[}"
  host="${host%]}"
  until "$FARSKIP_PYTHON" -c 'import socket, sys; socket.getaddrinfo(sys.argv[1], None)' "$host" 2>/dev/null; do
    if ((SECONDS >= resolve_deadline)); then
      echo "error: MASTER_ADDR=$MASTER_ADDR does not resolve on this node: use node 0's IP address, or fix DNS / /etc/hosts" >&2
      exit 2
    fi
    sleep 2
  done
  # SGLang's ZMQ peer allowlist (SGLANG_ZMQ_ALLOWED_PEERS; sglang/srt/utils/network.py,
  # restrict_zmq_peers): SGLang's TCP-bound ZMQ sockets (under DP attention node 0 binds them
  # on MASTER_ADDR, its load snapshot socket too) unpickle what they receive, and admit only
  # these source addresses: node 0 (MASTER_ADDR, which node 0's own processes also connect
  # to), the other nodes (WORKER_ADDRS), this node and loopback. SGLang compares IP addresses
  # (it parses each with `ipaddress` and fails on a name), so names are resolved here, retried
  # like MASTER_ADDR. SGLANG_ZMQ_SOURCE_IP makes this node's connections leave from
  # SGLANG_HOST_IP whatever other addresses the host has; node k>0 checks that this is the
  # address node 0 admits for it (WORKER_ADDRS' k-th), else node 0 would refuse it and the
  # rejected connection would wait without an error.
  resolve_all() {  # every address of a host name or IP, one line, space-separated
    "$FARSKIP_PYTHON" - "$1" <<'PY' 2>/dev/null
import socket, sys
print(*sorted({a[4][0] for a in socket.getaddrinfo(sys.argv[1], None, proto=socket.IPPROTO_TCP)}))
PY
  }
  IFS=',' read -ra worker_hosts <<<"${WORKER_ADDRS:-}"
  if [[ -z "${WORKER_ADDRS:-}" ]]; then
    echo "error: WORKER_ADDRS is not set: set it to node 1's address on the cluster network (the other nodes', comma-separated, in NODE_RANK order), the same on every node; node 0's SGLang admits ZMQ connections only from it" >&2
    exit 2
  elif ((${#worker_hosts[@]} != 10#$NNODES - 1)); then
    echo "error: WORKER_ADDRS=$WORKER_ADDRS names ${#worker_hosts[@]} address(es), NNODES=$NNODES needs $((10#$NNODES - 1)): set one address per node after node 0, comma-separated, in NODE_RANK order" >&2
    exit 2
  fi
  zmq_peers=(127.0.0.1 ::1)
  if [[ "$SGLANG_HOST_IP" != 127.0.0.1 ]]; then zmq_peers+=("$SGLANG_HOST_IP"); fi
  for worker_host in "$MASTER_ADDR" "${worker_hosts[@]}"; do
    worker_host="${worker_host#[}"
    worker_host="${worker_host%]}"
    if [[ ! "$worker_host" =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ && ! "$worker_host" =~ ^[0-9A-Fa-f:.]+$ ]]; then
      echo "error: WORKER_ADDRS=$WORKER_ADDRS: '$worker_host' is not a host name or IP address: give node 1's address, e.g. 10.0.0.2" >&2
      exit 2
    fi
    until worker_ips="$(resolve_all "$worker_host")"; do
      if ((SECONDS >= resolve_deadline)); then
        echo "error: WORKER_ADDRS=$WORKER_ADDRS: '$worker_host' does not resolve on this node: use the node's IP address, or fix DNS / /etc/hosts" >&2
        exit 2
      fi
      sleep 2
    done
    for worker_ip in $worker_ips; do
      if [[ " ${zmq_peers[*]} " != *" $worker_ip "* ]]; then zmq_peers+=("$worker_ip"); fi
    done
  done
  if ((10#$NODE_RANK > 0)); then
    read -ra own_ips <<<"$(resolve_all "${worker_hosts[10#$NODE_RANK - 1]}")"
    if [[ " ${own_ips[*]} " != *" $SGLANG_HOST_IP "* ]]; then
      echo "error: WORKER_ADDRS names ${worker_hosts[10#$NODE_RANK - 1]} (${own_ips[*]}) for node $NODE_RANK, but this node is SGLANG_HOST_IP=$SGLANG_HOST_IP: node 0 would refuse its ZMQ connections; set both to the same address (NET_IFNAME's)" >&2
      exit 2
    fi
  fi
  zmq_allowed="$(IFS=,; echo "${zmq_peers[*]}")"
  export SGLANG_ZMQ_ALLOWED_PEERS="$zmq_allowed" SGLANG_ZMQ_SOURCE_IP="$SGLANG_HOST_IP"
  echo "sglang-farskip: SGLang's ZMQ sockets admit $zmq_allowed" >&2
  export GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME SGLANG_HOST_IP
  if [[ "$MASTER_ADDR" == *:* && "$MASTER_ADDR" != \[* ]]; then
    dist_init_addr="[$MASTER_ADDR]:$MASTER_PORT"  # SGLang wants IPv6 in brackets
  else
    dist_init_addr="$MASTER_ADDR:$MASTER_PORT"
  fi
fi
export NCCL_DEBUG TORCH_NCCL_ASYNC_ERROR_HANDLING
if [[ "$FARSKIP_PLATFORM" == rocm ]]; then export GPU_MAX_HW_QUEUES; fi
# Empty optional variables are unset rather than passed on: NCCL reads "" as a value (and an
# empty Mooncake bound is no setting at all: Mooncake gets none unless both are given).
for var in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME NCCL_IB_HCA SGLANG_HOST_IP MC_MIN_RPC_PORT MC_MAX_RPC_PORT; do
  if [[ -z "${!var:-}" ]]; then unset "$var"; fi
done
if [[ -n "${MC_MIN_RPC_PORT:-}" ]]; then export MC_MIN_RPC_PORT MC_MAX_RPC_PORT; fi
if [[ -n "${NCCL_IB_HCA:-}" ]]; then export NCCL_IB_HCA; fi

# ---------------------------------------------------------------- command
cmd=("$FARSKIP_PYTHON" -m sglang_farskip.launch_server --farskip-mode "$FARSKIP_MODE")
if [[ "$MODEL_PATH" != demo ]]; then
  cmd+=(--model-path "$MODEL_PATH")
fi
cmd+=(
  --tp-size "$TP_SIZE" --ep-size "$EP_SIZE"
  # FarSkip replaces the MoE all-to-all with its own overlapped collectives.
  --moe-a2a-backend none
  --nnodes "$NNODES" --node-rank "$NODE_RANK"
  --dist-timeout "$DIST_TIMEOUT"
  --host "$HTTP_HOST" --port "$HTTP_PORT"
)
# SGLang's own PD flags; the launcher sets up the rest (Mooncake over TCP on CPU, cpu/pd.py).
if [[ "$PD_ROLE" != none ]]; then
  cmd+=(--disaggregation-mode "$PD_ROLE")
fi
if [[ "$PD_ROLE" == prefill ]]; then
  cmd+=(--disaggregation-bootstrap-port "$BOOTSTRAP_PORT")
fi
# The keys go to the launcher as files it reads itself (FARSKIP_API_KEY_FILE,
# FARSKIP_ADMIN_API_KEY_FILE), which gives them to SGLang as --api-key/--admin-api-key in its own
# memory: never on a command line (ps shows those to every user of the node), and never in an
# environment (/proc/PID/environ), neither the watchdog's, which lives as long as the
# deployment and starts the launcher again, nor any server process's. A key given as a file
# (API_KEY_FILE) is passed by its path; a key given as a value (API_KEY) is written to a file
# only this user can read, in a directory of its own, for the container's lifetime. (A key given
# as the variable API_KEY stays in the environment this script was started with, and so in
# PID 1's: compose gives it as a file instead; elsewhere use API_KEY_FILE, docs/deploy.md "Keys".)
key_to_file() { # key_to_file NAME: exports FARSKIP_NAME_FILE, the file the launcher reads NAME from
  local name=$1 value="key_$1" file="${1}_FILE" path
  if [[ -n "${!file:-}" ]]; then
    path="${!file}"
  elif [[ "$dry_run" == 1 ]]; then
    path="<a file of its own>"
  else
    keydir="${keydir:-$(mktemp -d -t farskip-keys.XXXXXX)}" # mode 700, in the temporary directory
    path="$keydir/$name"
    (umask 077 && printf '%s' "${!value}" >"$path")
  fi
  export "FARSKIP_${name}_FILE=$path"
}
unset FARSKIP_API_KEY FARSKIP_ADMIN_API_KEY FARSKIP_API_KEY_FILE FARSKIP_ADMIN_API_KEY_FILE
if [[ -n "$key_API_KEY" ]]; then key_to_file API_KEY; fi
if [[ -n "$key_ADMIN_API_KEY" ]]; then key_to_file ADMIN_API_KEY; fi
unset API_KEY ADMIN_API_KEY key_API_KEY key_ADMIN_API_KEY
if ((multinode)); then
  cmd+=(--dist-init-addr "$dist_init_addr")
fi
# No CUDA-graph flags here: the launcher alone decides them (gpu_overlap_graph_args), because
# only it knows whether the GPU side stream runs (tests/test_deploy_static.py checks this).
if [[ -n "${EXTRA_ARGS:-}" ]]; then
  read -ra extra <<<"$EXTRA_ARGS"
  cmd+=("${extra[@]}")
fi
cmd+=("$@")

# ---------------------------------------------------------------- watchdog (self-healing)
# The watchdog (python/sglang_farskip/serve/watchdog.py, whose docstring states the bound) asks
# node 0's API: node 0 on its own address (loopback when it listens on all), the other nodes at
# MASTER_ADDR, on HTTP_PORT. It arms at node 0's /health (the deployment is up) and restarts
# the server in place: WATCHDOG_RESTARTS failed starts in a row, each after a back-off from
# WATCHDOG_BACKOFF seconds doubling, then exit 71; a refused setting (exit 2) never restarts.
: "${WATCHDOG_RESTARTS:=5}"
: "${WATCHDOG_BACKOFF:=10}"
for var in WATCHDOG_RESTARTS WATCHDOG_BACKOFF; do
  if ! is_uint "${!var}"; then
    echo "error: $var=${!var} is not a whole number: set it to e.g. 5 (0: no restarts here)" >&2
    exit 2
  fi
done
# Node 1's watchdog must reach node 0's HTTP port at MASTER_ADDR; a loopback HTTP_HOST hides it
# from any other machine, so node 1 would never see the deployment up and a hang there would
# never be ended (issue 34). (Both nodes on one machine, MASTER_ADDR on loopback too, works.)
case "${MASTER_ADDR:-}" in
  127.* | ::1 | "[::1]" | localhost) master_loopback=1 ;;
  *) master_loopback=0 ;;
esac
if ((multinode)) && [[ "$WATCHDOG" == 1 && "$loopback" == 1 && "$master_loopback" == 0 ]]; then
  echo "error: HTTP_HOST=$HTTP_HOST with NNODES=$NNODES and MASTER_ADDR=$MASTER_ADDR: node 1's watchdog asks node 0's /health_generate at MASTER_ADDR:HTTP_PORT, which a loopback address hides; set HTTP_HOST=0.0.0.0 (or node 0's cluster address) and keep clients out with a firewall (deploy/firewall.nft), the same on both nodes" >&2
  exit 2
fi
# /health reports SGLang's server status (200 once the warm-up has generated through every
# rank) without generating itself: the watchdog's sign that the deployment is up. SGLang's
# default makes /health generate like /health_generate, which a hang fails.
export SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0
if ((10#$NODE_RANK == 0)); then
  case "$HTTP_HOST" in
    0.0.0.0) health_host=127.0.0.1 ;;
    :: | "[::]") health_host="[::1]" ;;
    *:*) health_host="[${HTTP_HOST#[}"; health_host="${health_host%]}]" ;;
    *) health_host="$HTTP_HOST" ;;
  esac
else
  health_host="${MASTER_ADDR#[}"
  health_host="${health_host%]}"
  if [[ "$health_host" == *:* ]]; then health_host="[$health_host]"; fi
fi
health_url="http://$health_host:$HTTP_PORT/health_generate"
if [[ "$WATCHDOG" == 1 ]]; then
  cmd=("$FARSKIP_PYTHON" -m sglang_farskip.serve.watchdog --url "$health_url"
    --up-url "http://$health_host:$HTTP_PORT/health"
    --interval "$WATCHDOG_INTERVAL" --timeout "$WATCHDOG_TIMEOUT" --failures "$WATCHDOG_FAILURES"
    --start-timeout "$WATCHDOG_START_TIMEOUT" --restarts "$WATCHDOG_RESTARTS"
    --backoff "$WATCHDOG_BACKOFF" -- "${cmd[@]}")
fi

{
  echo "sglang-farskip: node $NODE_RANK of $NNODES, platform $FARSKIP_PLATFORM, mode $FARSKIP_MODE, dist timeout ${DIST_TIMEOUT}s"
  if [[ "$PD_ROLE" != none ]]; then
    echo "sglang-farskip: prefill/decode disaggregation, role $PD_ROLE$([[ "$PD_ROLE" == prefill ]] && echo ", bootstrap port $BOOTSTRAP_PORT")"
  fi
  if [[ "$WATCHDOG" == 1 ]]; then
    echo "sglang-farskip: watchdog on $health_url (every ${WATCHDOG_INTERVAL}s, ${WATCHDOG_FAILURES} failures in a row end the server)"
  fi
  if ((multinode)); then
    echo "sglang-farskip: rendezvous at $dist_init_addr via ${NET_IFNAME}; this node is ${SGLANG_HOST_IP}"
  fi
} >&2

if [[ "$dry_run" == 1 ]]; then
  for var in "${FARSKIP_ENV_VARS[@]}"; do
    if [[ -v "$var" ]]; then printf '%s=%q\n' "$var" "${!var}"; fi
  done
  if [[ -v FARSKIP_API_KEY_FILE ]]; then echo "API_KEY=<set, not shown>"; fi
  if [[ -v FARSKIP_ADMIN_API_KEY_FILE ]]; then echo "ADMIN_API_KEY=<set, not shown>"; fi
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
exec "${cmd[@]}"
