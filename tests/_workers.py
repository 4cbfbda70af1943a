"""pytest plugin, loaded by scripts/test.sh (`-p tests._workers`) when FARSKIP_TEST_WORKERS is
not 0: how the suite is shared between pytest-xdist workers (`-n N --dist loadfile`).

Most of the suite is real servers starting, answering and being waited for. In one pytest
process a 2-core machine sat idle about a third of the time (CI, sampled from /proc/stat): a
node waiting out its collective timeout, a container restarting, a watchdog counting failed
checks, a server's single-threaded start-up. A second worker fills those gaps.

- Each test file runs whole on one worker, so its module-scoped servers start once (xdist's
  loadfile).
- Files that use the same host-wide names run on one worker, one after the other: the network
  namespaces and veth pair of tests/netns.py. A scheduler of our own does this: xdist's
  `xdist_group` marks do nothing under pytest 9.2 (xdist 3.8 renames `item._nodeid`, which
  pytest 9 no longer reads).
- The longest files are handed out first (longest-processing-time first), so that both workers
  end at about the same time; the others follow in collection order.

Not the default yet: beside a second worker one load-timing test (test_load_harness's
cross-check with sglang.benchmark.serving) failed its client-overhead bound.
"""

from __future__ import annotations

import pytest

# Files that share host-wide resources: one worker, one file after another.
SHARED = {
    "tests/test_deploy_two_nodes.py": "netns",
    "tests/test_firewall.py": "netns",
    "tests/test_watchdog.py": "netns",
}

# Longest first, from CI's time-per-file table (tests/_durations.py): seconds in one process.
LONGEST_FIRST = [
    "tests/test_docker.py",  # 550
    "tests/test_dp_attention.py",  # 260
    "netns",  # 250
    "tests/test_parallel.py",  # 215
    "tests/test_spec_farskip.py",  # 205
    "tests/test_fcsd.py",  # 180
    "tests/test_instella.py",  # 180
    "tests/test_load_harness.py",  # 165
    "tests/test_server_parity.py",  # 120
    "tests/test_cpu_mha.py",  # 110
]


def group_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED.get(path, path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs on each worker; xdist hands the files out in this order."""
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))  # stable: file order kept


@pytest.hookimpl(tryfirst=True)  # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return SharedFileScheduling(config, log)
