#!/usr/bin/env bash
# Install if needed, then run the whole test suite. Extra arguments go to pytest: options
# (-q, -k EXPR) still run the whole suite (pyproject's testpaths), test paths run only those
# (`./scripts/test.sh tests/test_load_stats.py`). The run ends with the time each test file
# took (tests/_durations.py).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/bootstrap.sh"
cd "$root"
# `python -m` puts the working directory (the root) on sys.path, so the plugin imports as
# tests._durations (tests/ has no __init__.py: a namespace package). `-p _durations` would
# need tests/ on PYTHONPATH, which every server and tool the tests start would inherit.
# FARSKIP_TEST_WORKERS=N: N pytest-xdist workers share the files (tests/_workers.py says how
# and why); 0, the default, runs everything in this one process.
# Not yet the default: one load-timing test failed beside a second worker (docs/testing.md).
workers="${FARSKIP_TEST_WORKERS:-0}"
args=(-p tests._durations)
if [ "$workers" != 0 ]; then
  args+=(-p tests._workers -n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec "$root/.venv/bin/python" -m pytest "${args[@]}" "$@"
