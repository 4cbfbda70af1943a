"""pytest plugin, loaded by scripts/test.sh (`-p _durations`): time per test file at the end of
the run. pytest's own --durations is per test phase; a file's cost is mostly its module-scoped
servers, which land in the setup of its first test, so only a per-file sum shows where CI's
time goes. Not a conftest.py so that it stays out of the shared helpers' way.

It also prints, after the table, every ("measured", line) a test put in its user_properties:
figures that docs quote, which reach the terminal this way from any pytest-xdist worker.
"""

from __future__ import annotations

from collections import defaultdict

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)
_skipped: dict[str, int] = defaultdict(int)
_failed: dict[str, int] = defaultdict(int)
_measured: list[str] = []


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::", 1)[0]
    _seconds[path] += report.duration
    if report.when == "setup":
        _tests[path] += 1
    if report.skipped and report.when in ("setup", "call"):
        _skipped[path] += 1
    if report.failed:
        _failed[path] += 1  # a test failing in call and teardown counts twice: rare, and visible
    if report.when == "teardown":
        _measured.extend(value for name, value in report.user_properties if name == "measured")


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    tr = terminalreporter
    total = sum(_seconds.values())
    width = max(len(p) for p in _seconds)
    tr.write_sep("=", "time per test file (setup + call + teardown; collection not included)")
    tr.write_line(f"{'file':<{width}}  {'tests':>5}  {'skipped':>7}  {'failed':>6}  {'seconds':>8}  {'share':>5}")
    for path, secs in sorted(_seconds.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{path:<{width}}  {_tests[path]:>5}  {_skipped[path]:>7}  {_failed[path]:>6}  "
                      f"{secs:>8.1f}  {100 * secs / total if total else 0:>4.0f}%")
    tr.write_line(f"{'total':<{width}}  {sum(_tests.values()):>5}  {sum(_skipped.values()):>7}  "
                  f"{sum(_failed.values()):>6}  {total:>8.1f}")
    if _measured:
        tr.write_sep("=", "measured")
        for line in _measured:
            tr.write_line(line)
