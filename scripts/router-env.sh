#!/usr/bin/env bash
# Create .venv-router at the repository root (if missing) and install SGLang's router into it,
# pinned (requirements/router.txt). Its own environment because it wants newer web packages than
# SGLang's (that file says which). scripts/bootstrap.sh runs this; idempotent: a stamp of the
# inputs skips work that is already done.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-router"
python="${PYTHON:-python3}"

want="$(cat "$root/requirements/router.txt" "$root/scripts/router-env.sh" | sha256sum | cut -d' ' -f1)"
if [ -f "$venv/.farskip-stamp" ] && [ "$(cat "$venv/.farskip-stamp")" = "$want" ]; then
  exit 0
fi
echo "== installing SGLang's router into $venv" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
log="$(mktemp)"
for attempt in 1 2 3; do  # as bootstrap.sh: a download cut short is tried again
  if "$venv/bin/python" -m pip --disable-pip-version-check --no-input install -q --retries 10 \
      -r "$root/requirements/router.txt" >"$log" 2>&1; then
    break
  fi
  if ((attempt == 3)) || ! grep -qi "download\|connection\|timed out" "$log"; then
    cat "$log" >&2
    rm -f "$log"
    echo "error: installing the router (requirements/router.txt) failed (log above)" >&2
    exit 1
  fi
  sleep 10
done
rm -f "$log"
"$venv/bin/python" -c 'import sglang_router.launch_router' \
  || { echo "error: $venv: sglang_router does not import" >&2; exit 1; }
echo "$want" > "$venv/.farskip-stamp"
echo "== router installed" >&2
