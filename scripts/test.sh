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
# and why); 0 runs everything in this one process. The default is 2 where there are 2 cores
# or more: most of the suite waits on servers, and one process left a 2-core machine idle a
# third of the time.
if [ -z "${FARSKIP_TEST_WORKERS:-}" ]; then
  if [ "$(nproc)" -ge 2 ]; then FARSKIP_TEST_WORKERS=2; else FARSKIP_TEST_WORKERS=0; fi
fi
workers="$FARSKIP_TEST_WORKERS"
args=(-p tests._durations)
if [ "$workers" != 0 ]; then
  args+=(-p tests._workers -n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec "$root/.venv/bin/python" -m pytest "${args[@]}" "$@"
