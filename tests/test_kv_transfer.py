"""serve/kv_transfer.py on SGLang's own KV manager class: a room the scheduler has already
forgotten reads as Failed, not a KeyError that ends the prefill server's transfer thread.

The race itself (the scheduler's `clear` between the transfer thread's membership test and its
`check_status`) needs two threads to interleave at one line; it was seen through a PD router
under load (docs/pd.md, "Failures") and cannot be forced from outside. What can be checked
exactly is the method the thread calls at that moment: SGLang's `CommonKVManager.check_status`,
with the hook applied as the plugin applies it, on a manager whose status table lacks the room.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def manager_class():
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_farskip import boundary

    boundary.install("every")  # what plugin.register() does in every process SGLang starts
    HookRegistry.apply_hooks()
    return CommonKVManager


def _manager(cls, statuses: dict):
    # The manager's constructor starts the transfer engine; check_status reads only this table.
    manager = object.__new__(cls)
    manager.request_status = statuses
    return manager


def test_a_known_room_reads_its_status(manager_class):
    from sglang.srt.disaggregation.base.conn import KVPoll

    manager = _manager(manager_class, {7: KVPoll.Success, 8: KVPoll.Transferring})
    assert manager.check_status(7) == KVPoll.Success
    assert manager.check_status(8) == KVPoll.Transferring


def test_a_forgotten_room_is_failed_not_a_keyerror(manager_class):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    assert _manager(manager_class, {7: KVPoll.Success}).check_status(9) == KVPoll.Failed
    # The transfer thread's own class inherits the method (it must not override it unhooked).
    assert _manager(MooncakeKVManager, {}).check_status(9) == KVPoll.Failed
