"""A fix to SGLang 0.5.23's prefill/decode KV transfer, on every device (the plugin installs it
in every SGLang process; it only matters on a PD prefill server).

The race. A prefill server's Mooncake transfer thread (`MooncakeKVManager.transfer_worker`,
disaggregation/mooncake/conn.py ~2855) decides whether to forget a request with

    room not in self.request_status or self.check_status(room) == KVPoll.Success ...

while the scheduler thread removes a finished request's entry (`CommonKVSender.clear`,
disaggregation/common/conn.py ~2425). When the removal falls between the membership test and
`check_status`, `check_status` raises KeyError; the transfer thread turns any exception into
"Transfer thread failed ... Prefill instance with bootstrap_port=N is dead" and ends. Nothing
restarts it: every later request waits for a KV transfer that never comes, while the server's
`/health` and `/health_generate` (which use a fake bootstrap and no transfer) stay 200, so no
health check sees it. Found here under 2 clients of 4-token requests through the router on two
busy cores: the deployment served ~1100 requests, then none (bench/soak.py through a PD router,
docs/pd.md "Failures"). Upstream has the same report for the scheduler's own `poll`
(Mooncake issue 1400) and unmerged fixes (sglang PRs 27162, 28003).

The fix: `check_status` of a room that is no longer known answers KVPoll.Failed instead of
raising. Every caller reads that as "this request is over" (the transfer thread skips its
chunks and forgets it on its last one; a sender's `poll` ends the request as failed, which the
client sees as an error instead of the scheduler crashing). The one cost: the transfer thread
keeps a forgotten room's small bookkeeping entry when the race hits a non-last chunk.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_farskip.serve.kv_transfer")

def missing_room_is_failed(original, manager, bootstrap_room, *args, **kwargs):
    """AROUND CommonKVManager.check_status (every SGLang process, every device; the plugin
    installs it from sglang_farskip/boundary/table.csv)."""
    try:
        return original(manager, bootstrap_room, *args, **kwargs)
    except KeyError:
        from sglang.srt.disaggregation.base.conn import KVPoll

        logger.debug("KV transfer: room %s was already forgotten; answering Failed", bootstrap_room)
        return KVPoll.Failed
