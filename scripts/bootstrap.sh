#!/usr/bin/env bash
# Create .venv at the repository root (if missing) and install everything, pinned:
# torch 2.14.1, sglang 0.5.23 (--no-deps: its declared deps are CUDA kernels), the CPU
# dependency set in requirements/cpu.txt, Mooncake for PD disaggregation
# (requirements/pd-cpu.txt), this package (editable), and the sgl_kernel CPU stand-in; and SGLang's
# router in its own .venv-router (scripts/router-env.sh). Idempotent: a stamp of the inputs
# skips work that is already done.
set -euo pipefail
shopt -s nullglob  # an empty patches/ is fine
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"

# Mooncake's engine links the Debian libraries in requirements/pd-cpu.debs even for its TCP
# transport; only prefill/decode disaggregation (PD) loads it. Checked on every run (the stamp
# below does not know the system): as root with apt, they are installed; otherwise everything
# else installs and serves without them, and the launcher refuses a PD server with one error:
# line naming the command, until they are installed.
ldconfig="$(command -v ldconfig || echo /sbin/ldconfig)"  # /sbin is not on every user's PATH
missing_pd_libs() {  # sets missing (library names) and packages (Debian packages)
  local libs package lib
  libs="$("$ldconfig" -p)"
  missing=() packages=()
  while read -r package lib; do
    [[ -z "$package" || "$package" == \#* ]] && continue
    grep -q "$lib" <<<"$libs" || { missing+=("$lib"); packages+=("$package"); }
  done <"$root/requirements/pd-cpu.debs"
}
missing_pd_libs
if ((${#missing[@]})) && ((EUID == 0)) && command -v apt-get >/dev/null 2>&1; then
  echo "== installing ${packages[*]} (Mooncake's transfer engine links them; for PD)" >&2
  apt_log="$(mktemp)"
  if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends "${packages[@]}"; } >"$apt_log" 2>&1; then
    tail -5 "$apt_log" >&2  # not fatal: only PD needs them (the warning below)
  fi
  rm -f "$apt_log"
  missing_pd_libs
fi
if ((${#missing[@]})); then
  echo "warning: ${missing[*]} not found: prefill/decode disaggregation (PD) is refused until" \
    "\`apt-get install ${packages[*]}\` is run as root; everything else installs and serves" >&2
fi

"$root/scripts/router-env.sh"

stamp_inputs() {
  cat "$root/requirements/cpu.txt" "$root/requirements/tools.txt" "$root/requirements/pd-cpu.txt" \
    "$root/pyproject.toml" \
    "$root/scripts/bootstrap.sh" "$root"/patches/*.patch
  echo "$root"
}
want="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
if [ -f "$venv/.farskip-stamp" ] && [ "$(cat "$venv/.farskip-stamp")" = "$want" ]; then
  exit 0
fi

if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 10))'; then
  echo "error: $python is older than Python 3.10; set PYTHON=python3.11" >&2
  exit 2
fi
echo "== installing into $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input)
# First, and plain: a new venv's pip may predate --resume-retries, which pip_install passes.
"${pip[@]}" install -q --upgrade pip
# A download cut mid-wheel (seen in CI: pyarrow's 55 MB, six resumes, still short) fails the
# whole install, and pip installs nothing until every wheel is in, so a retry is safe.
# pip_install tries PIP_ATTEMPTS times, each with pip's own resume and connection retries.
PIP_ATTEMPTS=3
pip_install() {
  local log attempt
  log="$(mktemp)"
  for ((attempt = 1; ; attempt++)); do
    if "${pip[@]}" install -q --retries 10 --resume-retries 20 "$@" >"$log" 2>&1; then
      break
    fi
    if ((attempt >= PIP_ATTEMPTS)) || ! grep -qi "download\|connection\|timed out" "$log"; then
      cat "$log" >&2
      rm -f "$log"
      echo "error: pip install $* failed (log above)" >&2
      exit 1
    fi
    echo "== pip install $*: network failure (attempt $attempt of $PIP_ATTEMPTS), retrying" >&2
    sleep 10
  done
  # pip reports SGLang's uninstalled CUDA-only requirements as conflicts: expected on CPU,
  # filtered from the output.
  grep -v "^sglang 0.5.23 requires\|dependency resolver does not\|^WARNING: Location" "$log" >&2 || true
  rm -f "$log"
}
pip_install torch==2.14.1 torchvision==0.29.1
pip_install --no-deps sglang==0.5.23
pip_install -r "$root/requirements/cpu.txt"
# Tools: no --no-deps, but the constraint keeps them off SGLang's pins.
if grep -q '^[^#[:space:]]' "$root/requirements/tools.txt"; then
  pip_install -r "$root/requirements/tools.txt" -c "$root/requirements/cpu.txt"
fi
pip_install -r "$root/requirements/pd-cpu.txt" -c "$root/requirements/cpu.txt" -c "$root/requirements/tools.txt"
pip_install --no-deps -e "$root"

# The stand-in goes *after* site-packages on sys.path, so a real sgl_kernel always wins. With
# FARSKIP_CPU_AMX_TWINS=1 (tests only) every process also imports it at start-up: its twins then
# stand in for AMX tiles too, before SGLang reads torch's tile check at import
# (python/cpu_shim/sgl_kernel/amx.py says why).
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n%s\n' "$root/python/cpu_shim" \
  'import os; os.environ.get("FARSKIP_CPU_AMX_TWINS") == "1" and __import__("sgl_kernel")' \
  > "$site/zz_sglang_farskip_cpu_shim.pth"

# Edits to SGLang that no plugin can make (patches/README.md); fails loudly if one is stale.
"$venv/bin/python" -m sglang_farskip.tools.patches apply >&2

"$venv/bin/python" - <<'PY'
import importlib.metadata as md, sys
v = md.version("sglang")
if v != "0.5.23":
    sys.exit(f"error: sglang {v} installed, sglang_farskip is pinned to 0.5.23")
import torch, transformers, sglang_farskip  # noqa: F401
PY
if ((${#missing[@]} == 0)); then  # PD's engine loads (it needs the libraries checked above)
  "$venv/bin/python" -c 'from mooncake.engine import TransferEngine'
fi
echo "$want" > "$venv/.farskip-stamp"
echo "== installed" >&2
