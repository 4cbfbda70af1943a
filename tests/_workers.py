"""pytest plugin, loaded by scripts/test.sh (`-p tests._workers`) when FARSKIP_TEST_WORKERS is
not 0: how the suite is shared between pytest-xdist workers (`-n N --dist loadfile`).

Most of the suite is real servers starting, answering and being waited for. In one pytest
process a 2-core machine sat idle about a third of the time (CI, sampled from /proc/stat): a
node waiting out its collective timeout, a container restarting, a watchdog counting failed
checks, a server's single-threaded start-up. A second worker fills those gaps.

- Each test file runs whole on one worker, so its module-scoped servers start once (xdist's
  loadfile).
- Files that use the same host-wide names run on one worker, one after the other: the network
  namespaces and veth pair of sglang_farskip/testbed/netns.py. A scheduler of our own does this: xdist's
  `xdist_group` marks do nothing under pytest 9.2 (xdist 3.8 renames `item._nodeid`, which
  pytest 9 no longer reads).
- The longest files are handed out first (longest-processing-time first), so that both workers
  end at about the same time; the others follow in collection order.
- Files in ALONE run last, each with no other file running: their checks compare timings of
  runs made one after the other, which a neighbour's load shifts (test_load_crosscheck.py failed
  its client-overhead bound beside a second worker: 43 ms against 39 ms).
"""

from __future__ import annotations

import pytest

# Files that share host-wide resources: one worker, one file after another. "docker": the
# container stacks of test_docker.py and test_compose_pd.py: each takes both cores while it
# starts (up to four ranks compiling), test_docker.py's self-healing bounds assume no other
# stack beside it, and its fixed 172.30.x subnet could meet a network Docker hands another.
SHARED = {
    "tests/test_deploy_two_nodes.py": "netns",
    "tests/test_firewall.py": "netns",
    "tests/test_watchdog.py": "netns",
    "tests/test_docker.py": "docker",
    "tests/test_compose_pd.py": "docker",
}

# Run last, one at a time, while every other worker is idle.
ALONE = {"tests/test_load_crosscheck.py"}

# Longest first, from CI's time-per-file table (tests/_durations.py): seconds in one process.
LONGEST_FIRST = [
    "docker",  # 800: tests/test_docker.py 550, tests/test_compose_pd.py 250 (124-344 s warm, ten runs)
    "tests/test_router_faults.py",  # 550-655 in busy runs (two files at once), before its PD cases got 50 s more each
    "tests/test_dp_attention.py",  # 260
    "netns",  # 250
    "tests/test_parallel.py",  # 215
    "tests/test_spec_farskip.py",  # 205
    "tests/test_fcsd.py",  # 180
    "tests/test_fresh_machine.py",  # 140 (an install in a container, then the demo)
    "tests/test_fuzz.py",  # 180 (one server, a 120 s budget)
    "tests/test_instella.py",  # 180
    "tests/test_load_harness.py",  # 165
    "tests/test_server_parity.py",  # 120
    "tests/test_fp8.py",  # 100
    "tests/test_cpu_mha.py",  # 110
    "tests/test_replicas.py",  # 96 (alone, beside other sessions' load; one run 140 s)
    "tests/test_pd.py",  # 85 (three runs alone: 83-86 s; 195 s once beside other servers)
    "tests/test_load_router.py",  # 25 (five runs in a row: 18-37 s, the slower beside other sessions' servers)
]


def group_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED.get(path, path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs on each worker; xdist hands the files out in this order."""
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> tuple[bool, int]:
        group = group_of(item.nodeid)
        return group in ALONE, rank.get(group, len(rank))

    items.sort(key=order)  # stable: file order kept within equal keys


@pytest.hookimpl(tryfirst=True)  # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        # An xdist worker holds back its last test until it gets more work or is shut down (pytest
        # runs a test only once it knows the next one), so "no test left anywhere" never comes
        # while work is queued. With an ALONE group next in the queue, one worker, the runner,
        # is kept; every other one is shut down as soon as it holds no more than that last test
        # (it then runs it and exits); the runner gets the group once the others have finished
        # and it holds no more than its own last test, which then runs first, alone too.
        def _alone_next(self) -> bool:
            return bool(self.workqueue) and next(iter(self.workqueue)) in ALONE

        def _start_alone(self) -> None:
            active = [n for n in self.nodes if not n.shutting_down]
            if not active:
                return
            runner, pending = active[0], lambda n: self._pending_of(self.assigned_work[n])
            for node in active[1:]:
                if pending(node) <= 1:
                    node.shutdown()
            if pending(runner) <= 1 and all(pending(n) == 0 for n in self.nodes if n is not runner):
                super()._assign_work_unit(runner)

        def _assign_work_unit(self, node) -> None:
            if self._alone_next():
                self._start_alone()
            else:
                super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            if self._alone_next():  # whichever worker reported: a shut-down one finishing counts too
                self._start_alone()
            else:
                super()._reschedule(node)

    return SharedFileScheduling(config, log)
