#!/usr/bin/env bash
# Build one of the images with the versions in docker/versions.env.
#
#   docker/build.sh rocm|cuda|cpu|router [--print] [--local-base] [extra `docker build` arguments...]
#
# rocm, cuda, cpu: the servers' images; router: SGLang's router (docker/Dockerfile.router).
# The image is tagged $FARSKIP_IMAGE if set, else sglang-farskip:<FARSKIP_VERSION>-<flavour>,
# the name deploy/compose.yaml uses by default. --print shows the command instead of running it
# (and checks nothing below).
#
# Bases (the Dockerfile's *_IMAGE arguments, from versions.env or --build-arg NAME=IMAGE): a
# release build takes a registry image only by digest, NAME[:TAG]@sha256:<64 hex>, and refuses
# anything else (exit 2, one line), the placeholders in versions.env included. --local-base is
# for bases built on this machine (the tests' stand-ins, made without a registry): each must be
# an image the local engine already has, so nothing is pulled by tag.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
versions="$root/docker/versions.env"

flavour="${1:-}"
case "$flavour" in
  rocm | cuda | cpu | router) shift ;;
  *) echo "usage: $0 rocm|cuda|cpu|router [--print] [--local-base] [docker build arguments...]" >&2; exit 2 ;;
esac
print=0 local_base=0
while [[ "${1:-}" == --print || "${1:-}" == --local-base ]]; do
  case "$1" in
    --print) print=1 ;;
    --local-base) local_base=1 ;;
  esac
  shift
done
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

tag="${FARSKIP_IMAGE:-sglang-farskip:${version[FARSKIP_VERSION]}-$flavour}"
cmd=(docker build -f "$dockerfile" -t "$tag" "${args[@]}" "$@" "$root")
if ((print)); then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
# The bases this build starts from: each *_IMAGE argument the Dockerfile declares, as given on
# the command line (docker takes the last --build-arg of a name) or else in versions.env.
declare -A base=()
for name in "${!version[@]}"; do
  if [[ "$name" == *_IMAGE ]] && grep -q "^ARG $name\$" "$dockerfile"; then base[$name]="${version[$name]}"; fi
done
argv=("$@")
for ((i = 0; i < ${#argv[@]}; i++)); do
  arg="${argv[i]}"
  if [[ "$arg" == --build-arg && $((i + 1)) -lt ${#argv[@]} ]]; then
    i=$((i + 1))
    arg="${argv[i]}"
  elif [[ "$arg" == --build-arg=* ]]; then
    arg="${arg#--build-arg=}"
  else
    continue
  fi
  name="${arg%%=*}"
  if [[ -n "${base[$name]+set}" ]]; then base[$name]="${arg#*=}"; fi
done
for name in "${!base[@]}"; do
  image="${base[$name]}"
  if ((!local_base)) && [[ ! "$image" =~ ^[^[:space:]@]+@sha256:[0-9a-f]{64}$ ]]; then
    # The ROCm tag carries a build date that versions.env cannot know in advance.
    dated=""
    [[ "$image" == *YYYYMMDD* ]] && dated="put the published tag's date for YYYYMMDD, then "
    echo "error: $name=$image is not pinned by digest: a release build takes a registry base only as" \
      "NAME:TAG@sha256:<64 hex>; ${dated}write its digest into $versions (\`docker buildx imagetools inspect ${image%@*}\`" \
      "or \`crane digest ${image%@*}\` prints it; docs/deploy.md, \"Pinned bases\"), or pass --local-base for a base built on this machine" >&2
    exit 2
  fi
done
if ! command -v docker >/dev/null 2>&1; then
  echo "error: docker is not installed; install Docker Engine (or run with --print)" >&2
  exit 2
fi
if ((local_base)); then
  for name in "${!base[@]}"; do
    if ! docker image inspect "${base[$name]}" >/dev/null 2>&1; then
      echo "error: --local-base: $name=${base[$name]} is not an image this Docker engine has; build the" \
        "stand-in first (tests/docker_images.py), or drop --local-base and build from a registry base by digest" >&2
      exit 2
    fi
  done
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
  DOCKER_BUILDKIT=0 docker build -f "docker/Dockerfile.$flavour" -t "$tag" "${args[@]}" "$@" -
