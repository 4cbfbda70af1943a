#!/usr/bin/env bash
# Install if needed, then serve the tiny built-in FarSkip model on CPU at 127.0.0.1:30000.
# Extra arguments pass through to `python -m sglang_farskip.launch_server`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/python" -m sglang_farskip.launch_server "$@"
