"""deploy/firewall.nft, loaded for real into a network namespace standing for node 0: the other
node (PEER) reaches every inter-node port, any other address reaches only HTTP_PORT (and ports
outside the inter-node ranges). The stranger is a second address on the peer's side, so both
connect over the same link and differ only in their source address.

Checked first without the rules, where the stranger reaches everything: the check can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "firewall.nft"
NS = ("fsfw0", "fsfw1")  # our own names: sglang_farskip/testbed/netns.py uses fstest*
VETH = ("fsfw-veth0", "fsfw-veth1")
NODE0, PEER, STRANGER = "10.252.0.1", "10.252.0.2", "10.252.0.3"
MASTER_PORT, HTTP_PORT = 51000, 30000
# Port -> what it stands for; the first four must be closed to strangers.
INTER_NODE = {MASTER_PORT: "rendezvous", MASTER_PORT + 7: "last ZMQ port", 25000: "SGLang's NCCL port range",
              40000: "ephemeral (NCCL/gloo listeners)"}
OPEN = {HTTP_PORT: "HTTP", 20000: "unrelated service"}

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("nft"),
                                reason="needs root and nft (ip netns; Debian's nftables package)")

LISTEN = r"""
import socket, sys, threading
def serve(s):
    while True:
        c, _ = s.accept(); c.close()
for port in map(int, sys.argv[1:]):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(16)
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
"""

CONNECT = r"""
import json, socket, sys
source, target, ports = sys.argv[1], sys.argv[2], map(int, sys.argv[3:])
out = {}
for port in ports:
    s = socket.socket(); s.settimeout(1.5); s.bind((source, 0))
    try:
        s.connect((target, port)); out[port] = True
    except OSError:
        out[port] = False
    finally:
        s.close()
print(json.dumps(out))
"""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture(scope="module")
def nodes():
    for ns in NS:
        ip("netns", "del", ns, check=False)
    try:
        for ns in NS:
            ip("netns", "add", ns)
        ip("link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for ns, veth, addrs in ((NS[0], VETH[0], [NODE0]), (NS[1], VETH[1], [PEER, STRANGER])):
            ip("link", "set", veth, "netns", ns)
            for addr in addrs:
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            ip("-n", ns, "link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        listener = subprocess.Popen(["ip", "netns", "exec", NS[0], sys.executable, "-c", LISTEN,
                                     *map(str, [*INTER_NODE, *OPEN])], stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout.readline().strip() == "listening"
            yield
        finally:
            listener.kill()
            listener.wait()
    finally:
        for ns in NS:
            ip("netns", "del", ns, check=False)


def reachable(source: str) -> dict[int, bool]:
    proc = subprocess.run(["ip", "netns", "exec", NS[1], sys.executable, "-c", CONNECT, source, NODE0,
                           *map(str, [*INTER_NODE, *OPEN])], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return {int(k): v for k, v in json.loads(proc.stdout).items()}


def rendered_rules(tmp_path: Path) -> Path:
    text = RULES.read_text()
    for define, value in (("PEER", PEER), ("MASTER_PORTS", f"{MASTER_PORT}-{MASTER_PORT + 7}"),
                          ("HTTP_PORT", str(HTTP_PORT))):
        lines = [line for line in text.splitlines() if line.startswith(f"define {define} = ")]
        assert len(lines) == 1, f"{RULES} has no single `define {define} = ...` line to set"
        text = text.replace(lines[0], f"define {define} = {value}")
    out = tmp_path / "firewall.nft"
    out.write_text(text)
    return out


def test_only_the_peer_reaches_the_inter_node_ports(nodes, tmp_path):
    everything = dict.fromkeys([*INTER_NODE, *OPEN], True)
    assert reachable(STRANGER) == everything  # without the rules: the stranger gets in
    rules = rendered_rules(tmp_path)
    subprocess.run(["ip", "netns", "exec", NS[0], "nft", "-f", str(rules)], check=True, timeout=30)
    # Loaded twice, as after an edit: the table is replaced, not duplicated.
    subprocess.run(["ip", "netns", "exec", NS[0], "nft", "-f", str(rules)], check=True, timeout=30)
    listed = subprocess.run(["ip", "netns", "exec", NS[0], "nft", "list", "table", "inet", "sglang_farskip"],
                            capture_output=True, text=True, check=True, timeout=30).stdout
    assert listed.count("ip saddr") == 1, listed
    assert reachable(PEER) == everything
    stranger = reachable(STRANGER)
    assert stranger == {**dict.fromkeys(INTER_NODE, False), **dict.fromkeys(OPEN, True)}, \
        {f"{port} ({what})": stranger[port] for port, what in {**INTER_NODE, **OPEN}.items()}
