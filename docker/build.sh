#!/usr/bin/env bash
# Build one of the images with the versions in docker/versions.env.
#
#   docker/build.sh rocm|cuda|cpu [--print] [extra `docker build` arguments...]
#
# The image is tagged $FARSKIP_IMAGE if set, else sglang-farskip:<FARSKIP_VERSION>-<flavour>,
# the name deploy/compose.yaml uses by default. --print shows the command instead of running it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
versions="$root/docker/versions.env"

flavour="${1:-}"
case "$flavour" in
  rocm | cuda | cpu) shift ;;
  *) echo "usage: $0 rocm|cuda|cpu [--print] [docker build arguments...]" >&2; exit 2 ;;
esac
print=0
if [[ "${1:-}" == --print ]]; then print=1; shift; fi
dockerfile="$root/docker/Dockerfile.$flavour"

# Read KEY=VALUE lines without executing the file; anything else is a mistake worth stopping on.
declare -A version=()
lineno=0
while IFS= read -r line || [[ -n "$line" ]]; do
  lineno=$((lineno + 1))
  [[ -z "$line" || "$line" == \#* ]] && continue
  if [[ ! "$line" =~ ^([A-Z][A-Z0-9_]*)=([^[:space:]]+)$ ]]; then
    echo "error: $versions:$lineno: expected KEY=VALUE with no spaces or inline comment, got: $line" >&2
    exit 2
  fi
  version["${BASH_REMATCH[1]}"]="${BASH_REMATCH[2]}"
done <"$versions"

# Pass exactly the ARGs this Dockerfile declares; each one must have a value in versions.env.
args=()
while read -r name; do
  if [[ -z "${version[$name]:-}" ]]; then
    echo "error: $dockerfile declares ARG $name but $versions does not set it: add $name=..." >&2
    exit 2
  fi
  args+=(--build-arg "$name=${version[$name]}")
done < <(sed -n 's/^ARG \([A-Z][A-Z0-9_]*\).*/\1/p' "$dockerfile" | sort -u)

image="${FARSKIP_IMAGE:-sglang-farskip:${version[FARSKIP_VERSION]}-$flavour}"
cmd=(docker build -f "$dockerfile" -t "$image" "${args[@]}" "$@" "$root")
if ((print)); then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
# The ROCm base is tagged with its build date (vX.Y.Z-rocm724-mi30x-YYYYMMDD), which could not be
# looked up where versions.env was written: until someone pins the real tag (or a digest),
# building from the undated name would fail late inside docker, or pull something unpinned.
if [[ "$flavour" == rocm && " $* " != *" SGLANG_ROCM_IMAGE="* && " $* " != *" --build-arg=SGLANG_ROCM_IMAGE="* ]] &&
  [[ ! "${version[SGLANG_ROCM_IMAGE]}" =~ (-[0-9]{8}|@sha256:[0-9a-f]{64})$ ]]; then
  echo "error: $versions: SGLANG_ROCM_IMAGE=${version[SGLANG_ROCM_IMAGE]} is not a dated tag or digest;" \
    "set it to the published v${version[SGLANG_VERSION]} tag (lmsysorg/sglang-rocm:v${version[SGLANG_VERSION]}-rocm724-mi30x-YYYYMMDD," \
    "from Docker Hub), or pass --build-arg SGLANG_ROCM_IMAGE=IMAGE" >&2
  exit 2
fi
if ! command -v docker >/dev/null 2>&1; then
  echo "error: docker is not installed; install Docker Engine (or run with --print)" >&2
  exit 2
fi
if docker buildx version >/dev/null 2>&1; then
  # BuildKit reads docker/Dockerfile.<flavour>.dockerignore, which keeps .venv/ out.
  DOCKER_BUILDKIT=1 exec "${cmd[@]}"
fi
# The classic builder (Debian's docker.io has no buildx plugin) reads only a .dockerignore at
# the context root and would send the whole checkout, .venv/ included (gigabytes). It gets the
# context that docker/Dockerfile.<flavour>.dockerignore allows, packed here as a tar stream.
ignore="$dockerfile.dockerignore"
include=() exclude=()
first=""
while IFS= read -r line || [[ -n "$line" ]]; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  if [[ -z "$first" ]]; then
    first="$line"
    if [[ "$line" != "*" ]]; then
      echo "error: $ignore must be an allow-list starting with '*' (then '!path' lines), got: $line" >&2
      exit 2
    fi
    continue
  fi
  case "$line" in
    !*) include+=("${line#!}") ;;
    *) exclude+=("--exclude=${line#\*\*/}") ;;
  esac
done <"$ignore"
tar -C "$root" -c "${exclude[@]}" -- "docker/Dockerfile.$flavour" "${include[@]}" |
  DOCKER_BUILDKIT=0 docker build -f "docker/Dockerfile.$flavour" -t "$image" "${args[@]}" "$@" -
