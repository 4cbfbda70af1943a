#!/usr/bin/env bash
# Make a stand-in for python:3.11-slim-bookworm from Debian's own packages, for machines that
# reach Debian's and PyPI's mirrors but no container registry (this project's CI). It is NOT the
# official image: Debian's python3.11 (3.11.2) and its headers (the official image has them;
# torch's inductor compiles against Python.h) in a venv at /usr/local, so `python` and `pip`
# resolve as in the official image, plus this host's CA bundle (where a TLS-intercepting proxy
# stands between the machine and PyPI, pip in a container trusts only what the host trusts).
#
#   docker/standin/python-base.sh      prints the image name; builds it only if missing
#
# The tag is a hash of this script and the CA bundle, so a second run costs nothing. Needs root,
# debootstrap and a Docker engine.
set -euo pipefail
suite=bookworm
ca=/etc/ssl/certs/ca-certificates.crt
hash="$(cat "${BASH_SOURCE[0]}" "$ca" | sha256sum | cut -c1-12)"
image="farskip-standin/python:3.11-$suite-$hash"
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "$image"
  exit 0
fi
for tool in debootstrap docker; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "error: $tool is not installed: apt-get install debootstrap docker.io" >&2
    exit 2
  fi
done
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
log="$root.debootstrap.log"
if ! debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3.11-dev,python3-pip,ca-certificates \
  "$suite" "$root" >"$log" 2>&1; then
  tail -20 "$log" >&2
  echo "error: debootstrap $suite failed (log above, full log in $log)" >&2
  exit 1
fi
rm -f "$log"
chroot "$root" python3.11 -m venv /usr/local
cp "$ca" "$root$ca"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
  --change "ENV PIP_CERT=$ca" \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --message "stand-in for python:3.11-slim-$suite, from Debian packages (docker/standin/python-base.sh)" \
  - "$image" >/dev/null
echo "$image"
