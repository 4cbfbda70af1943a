"""Prefill/decode KV transfer on every device: a fix to SGLang 0.5.23's (the plugin installs it
in every SGLang process; it only matters on a PD prefill server), and the launcher's refusal of
a PD server whose transfer engine cannot load (`require_transfer_engine`, at the end).

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

import ctypes
import logging
from pathlib import Path

from sglang_farskip.errors import UserError

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


# The Debian packages of the libraries Mooncake's engine links (read by scripts/bootstrap.sh,
# which installs them as root); present in a checkout, not in an installed wheel.
_DEBS = Path(__file__).resolve().parents[3] / "requirements" / "pd-cpu.debs"


def require_transfer_engine(resolved) -> None:
    """A prefill or decode server with Mooncake (SGLang's default transfer backend) needs its
    engine to load. Without its system libraries (a fresh machine: scripts/bootstrap.sh installs
    them only as root) SGLang's scheduler would crash at start with a traceback; refused here,
    before anything starts, with the command that fixes it."""
    if resolved.disaggregation_mode not in ("prefill", "decode"):
        return
    if resolved.disaggregation_transfer_backend != "mooncake":  # mooncake_tcp resolves to it
        return
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ModuleNotFoundError as e:
        raise UserError(
            f"--disaggregation-mode {resolved.disaggregation_mode} moves the KV cache with Mooncake's "
            f"transfer engine, which is not installed ({e}): install it (`pip install -r "
            "requirements/pd-cpu.txt` on CPU, ./scripts/bootstrap.sh does), or give another "
            "--disaggregation-transfer-backend") from None
    except (ImportError, OSError) as e:
        raise UserError(
            f"--disaggregation-mode {resolved.disaggregation_mode} moves the KV cache with Mooncake's "
            f"transfer engine, which does not load ({e}): {_install_command()}") from None


def _install_command() -> str:
    """What installs the missing system libraries, as exactly as this machine lets us say."""
    missing = []
    if _DEBS.is_file():
        for line in _DEBS.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                package, library = line.split()
                try:
                    ctypes.CDLL(library)
                except OSError:
                    missing.append(package)
    if missing:
        return (f"run `apt-get install {' '.join(missing)}` as root (or ./scripts/bootstrap.sh as "
                "root, which does), then start the server again")
    return "install the system libraries it names (`ldd` on mooncake/engine.so lists them), then start again"
