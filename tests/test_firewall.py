"""deploy/firewall.nft, loaded for real into network namespaces: node 0 (fsal0), node 1 (fsal1)
and a stranger (fsal2), one LAN (a bridge in fsal2) with IPv4 and IPv6 addresses.

- The probe: from the stranger, node 0 answers only on HTTP_PORT, IPv4 and IPv6; every
  inter-node port is closed (rendezvous and ZMQ ports, NCCL's range, the ephemeral range,
  pyzmq's dispatch ports above 60999, and a port below them that no denylist named). From the
  peer everything answers. Checked first without the rules, where the stranger reaches
  everything: the check can fail. Two planted holes (a table for IPv4 only; the old denylist)
  must each be found.
- The servers: with the ruleset on both nodes, a two-node TP=2 and a two-node DP-attention
  server started through deploy/entrypoint.sh (which sets SGLang's ZMQ peer allowlist from
  MASTER_ADDR and WORKER_ADDRS) answer a completion from the stranger's address.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_farskip.testbed import netns
from sglang_farskip.testbed.netns import Names, Node, kill_namespace_pids, node_env

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "firewall.nft"
# Our own names and addresses (other tests use fstest*, fsbench*).
NAMES = Names(("fsal0", "fsal1"), ("fsal-0", "fsal-1"), ("10.249.0.1", "10.249.0.2"))
STRANGER_NS, BRIDGE = "fsal2", "fsal-br"
V6 = ("fd49::1", "fd49::2")
STRANGER, STRANGER6 = "10.249.0.3", "fd49::3"
HTTP_PORT, MASTER_PORT = 30000, 50000
# Port -> what it stands for: each must be closed to the stranger. 20000 and 61500 were open
# under the old denylist (a service outside its ranges; pyzmq binds in 49152-65535).
INTER_NODE = {MASTER_PORT: "rendezvous (MASTER_PORT)", MASTER_PORT + 7: "last ZMQ port (MASTER_PORT+7)",
              25000: "SGLang's NCCL port range", 40000: "ephemeral range (NCCL/gloo listeners)",
              61500: "pyzmq dispatch port above the ephemeral range", 20000: "a port no denylist named",
              22: "SSH from outside ADMIN_NET"}
PORTS = [HTTP_PORT, *INTER_NODE]
SERVE_TIMEOUT_S = 420  # a two-node CPU start takes 1-2 min on a busy 2-core machine

pytestmark = [
    pytest.mark.skipif(netns.available() is not None or not shutil.which("nft"),
                       reason=f"{netns.available() or 'needs nft'} (ip netns; Debian's nftables package)"),
    pytest.mark.timeout(1200),
]

LISTEN = r"""
import socket, sys, threading
def serve(s):
    while True:
        c, _ = s.accept(); c.close()
for port in map(int, sys.argv[1:]):
    s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 and IPv6 alike
    s.bind(("::", port)); s.listen(16)
    threading.Thread(target=serve, args=(s,), daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
"""

CONNECT = r"""
import json, socket, sys
target, ports = sys.argv[1], map(int, sys.argv[2:])
out = {}
for port in ports:
    s = socket.socket(socket.AF_INET6 if ":" in target else socket.AF_INET); s.settimeout(0.5)  # one bridge away: a drop, not a slow link
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


def remove_lan() -> None:
    for ns in (*NAMES.ns, STRANGER_NS):
        kill_namespace_pids(ns)
        ip("netns", "del", ns, check=False)


def make_lan() -> None:
    """fsal0 and fsal1 each with one veth end, the other ends on a bridge in fsal2, which also
    holds the stranger's addresses."""
    remove_lan()
    for ns in (*NAMES.ns, STRANGER_NS):
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
    ip("-n", STRANGER_NS, "link", "add", BRIDGE, "type", "bridge")
    for rank in (0, 1):
        ns, veth, outer = NAMES.ns[rank], NAMES.veth[rank], f"{NAMES.veth[rank]}b"
        ip("-n", STRANGER_NS, "link", "add", outer, "type", "veth", "peer", "name", veth, "netns", ns)
        ip("-n", STRANGER_NS, "link", "set", outer, "master", BRIDGE, "up")
        ip("-n", ns, "addr", "add", f"{NAMES.addr[rank]}/24", "dev", veth)
        ip("-n", ns, "addr", "add", f"{V6[rank]}/64", "dev", veth, "nodad")
        ip("-n", ns, "link", "set", veth, "up")
    ip("-n", STRANGER_NS, "addr", "add", f"{STRANGER}/24", "dev", BRIDGE)
    ip("-n", STRANGER_NS, "addr", "add", f"{STRANGER6}/64", "dev", BRIDGE, "nodad")
    ip("-n", STRANGER_NS, "link", "set", BRIDGE, "up")


@pytest.fixture(scope="module")
def lan():
    make_lan()
    try:
        yield
    finally:
        remove_lan()


def rendered_rules(tmp_path: Path, text: str | None = None, peer: int = 1) -> Path:
    """The ruleset with the defines set for this LAN, as an operator sets them on node 1-peer."""
    text = RULES.read_text() if text is None else text
    for define, value in (("PEER", NAMES.addr[peer]), ("PEER6", V6[peer]), ("HTTP_PORT", str(HTTP_PORT))):
        lines = [line for line in text.splitlines() if line.startswith(f"define {define} = ")]
        assert len(lines) == 1, f"{RULES} has no single `define {define} = ...` line to set"
        text = text.replace(lines[0], f"define {define} = {value}")
    out = tmp_path / f"firewall-peer{peer}.nft"
    out.write_text(text)
    return out


def load(rank: int, rules: Path) -> None:
    subprocess.run(["ip", "netns", "exec", NAMES.ns[rank], "nft", "-f", str(rules)], check=True,
                   timeout=30, capture_output=True)


def unload(rank: int) -> None:
    subprocess.run(["ip", "netns", "exec", NAMES.ns[rank], "nft", "delete", "table", "inet",
                    "sglang_farskip"], timeout=30, capture_output=True)


def reachable(from_ns: str, target: str, ports=PORTS) -> dict[int, bool]:
    proc = subprocess.run(["ip", "netns", "exec", from_ns, sys.executable, "-c", CONNECT, target,
                           *map(str, ports)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {int(k): v for k, v in json.loads(proc.stdout).items()}


def holes(from_ns: str) -> dict[str, list[str]]:
    """What the stranger reaches on node 0 beyond HTTP_PORT, per address family ({} when the
    ruleset holds), plus HTTP_PORT itself if it is closed."""
    found = {}
    for family, target in (("IPv4", NAMES.addr[0]), ("IPv6", V6[0])):
        seen = reachable(from_ns, target)
        wrong = [f"{port} ({INTER_NODE[port]}) open" for port in INTER_NODE if seen[port]]
        wrong += [f"{HTTP_PORT} (HTTP) closed"] if not seen[HTTP_PORT] else []
        if wrong:
            found[family] = wrong
    return found


@pytest.fixture
def listener(lan):
    """Listeners on node 0 for each probed port, for one test: gone before the servers start
    (they bind HTTP_PORT and MASTER_PORT)."""
    proc = subprocess.Popen(["ip", "netns", "exec", NAMES.ns[0], sys.executable, "-c", LISTEN,
                             *map(str, PORTS)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "listening"
        yield
    finally:
        proc.kill()
        proc.wait()


def test_only_the_peer_reaches_the_inter_node_ports(listener, tmp_path):
    everything = dict.fromkeys(PORTS, True)
    unload(0)
    for target in (NAMES.addr[0], V6[0]):  # without the rules: the stranger gets in
        assert reachable(STRANGER_NS, target) == everything
    rules = rendered_rules(tmp_path)
    load(0, rules)
    try:
        load(0, rules)  # again, as after an edit: the table is replaced, not duplicated
        listed = subprocess.run(["ip", "netns", "exec", NAMES.ns[0], "nft", "list", "table", "inet",
                                 "sglang_farskip"], capture_output=True, text=True, check=True,
                                timeout=30).stdout
        assert listed.count("policy drop") == 1 and listed.count(f"ip saddr {NAMES.addr[1]} accept") == 1, listed
        for target in (NAMES.addr[0], V6[0]):
            assert reachable(NAMES.ns[1], target) == everything
        assert holes(STRANGER_NS) == {}
    finally:
        unload(0)


# A planted hole -> (how the ruleset text is broken, what the probe must then find).
PLANTED = {
    "a table for IPv4 only": (lambda t: t.replace("table inet sglang_farskip", "table ip sglang_farskip")
                              .replace("    ip6 saddr", "    # ip6 saddr").replace("    icmpv6", "    # icmpv6"),
                              "IPv6"),
    "the old denylist": (lambda t: re.sub(r"policy drop;", "policy accept;", t) + (
        "\ntable inet sglang_farskip {\n  chain input {\n"
        "    tcp dport { 50000-50007, 22000-29999, 32768-60999 } drop\n  }\n}\n"), "61500"),
}


@pytest.mark.parametrize("hole", PLANTED)
def test_the_probe_finds_a_planted_hole(listener, tmp_path, hole):
    breakage, expected = PLANTED[hole]
    load(0, rendered_rules(tmp_path, breakage(RULES.read_text())))
    try:
        found = holes(STRANGER_NS)
    finally:
        subprocess.run(["ip", "netns", "exec", NAMES.ns[0], "nft", "flush", "ruleset"], timeout=30)
    assert found and expected in json.dumps(found), found


# ------------------------------------------------------------------ two nodes behind the rules
def ask(path: str, payload: dict, timeout: float) -> dict:
    """One request from the stranger's address (a client), through node 0's firewall."""
    out = subprocess.run(["ip", "netns", "exec", STRANGER_NS, sys.executable, "-m", "sglang_farskip.testbed.netns",
                          "client", f"http://{NAMES.addr[0]}:{HTTP_PORT}", path, json.dumps(payload), str(timeout)],
                         capture_output=True, text=True, timeout=timeout + 60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_pair(tmp_path: Path, name: str, extra_args: str, node0_extra: dict | None = None) -> list[Node]:
    common = dict(master_port=MASTER_PORT, http_port=HTTP_PORT, dist_timeout=60, model_path="demo",
                  names=NAMES)
    nodes = []
    for rank in (0, 1):
        env = node_env(rank, **common)
        env["EXTRA_ARGS"] += f" {extra_args}"
        env["WATCHDOG"] = "0"  # nothing here to restart it
        if rank == 0:
            env.update(node0_extra or {})
        nodes.append(Node(rank, env, tmp_path / f"{name}-node{rank}.log", names=NAMES).start())
    return nodes


def wait_serving(nodes: list[Node], timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        for node in nodes:
            assert node.poll() is None, node.log_tail()
        if ask("/v1/models", {}, 10)["done"]:  # a GET answered in JSON once the server is up
            return time.monotonic() - start
        time.sleep(3)
    raise AssertionError(f"not serving after {timeout} s\n" + "\n".join(n.log_tail() for n in nodes))


@pytest.mark.parametrize("layout,args", [("tp", ""), ("dp-attention", "--dp-size 2 --enable-dp-attention")])
def test_two_nodes_serve_behind_the_rules(lan, tmp_path, layout, args):
    for rank in (0, 1):
        load(rank, rendered_rules(tmp_path, peer=1 - rank))
    nodes = start_pair(tmp_path, layout, args)
    try:
        took = wait_serving(nodes, SERVE_TIMEOUT_S)
        reply = ask("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                        "temperature": 0, "ignore_eos": True}, 120)
        assert reply["error"] is None and reply["reply"]["usage"]["completion_tokens"] == 4, reply
        assert "SGLang's ZMQ sockets admit 127.0.0.1,::1,10.249.0.1,10.249.0.2" in nodes[0].log()
        # The ports the servers really opened: of those the other node reaches (what listens on
        # a wildcard address of that family), the stranger reaches HTTP_PORT alone. Node 1's
        # HTTP_PORT is SGLang's dummy health server (deploy/firewall.nft says why).
        opened = {rank: sorted(listening_ports_of(rank)) for rank in (0, 1)}
        for rank in (0, 1):
            for target in (NAMES.addr[rank], V6[rank]):
                peer = {p for p, ok in reachable(NAMES.ns[1 - rank], target, opened[rank]).items() if ok}
                stranger = {p for p, ok in reachable(STRANGER_NS, target, opened[rank]).items() if ok}
                assert stranger == peer & {HTTP_PORT}, (rank, target, sorted(peer), sorted(stranger))
                if ":" not in target:  # the servers listen on IPv4: the peer reaches more than HTTP
                    assert peer - {HTTP_PORT}, (rank, opened[rank])
        print(f"\n{layout}: serving {took:.0f} s after the start behind the rules; listening "
              f"(closed to the stranger but HTTP): {opened}")
    finally:
        for node in nodes:
            node.kill()
        for rank in (0, 1):
            unload(rank)


def listening_ports_of(rank: int) -> set[int]:
    out = subprocess.run(["ip", "netns", "exec", NAMES.ns[rank], "cat", "/proc/net/tcp", "/proc/net/tcp6"],
                         capture_output=True, text=True, timeout=30).stdout
    return {int(f[1].rsplit(":", 1)[1], 16) for f in (line.split() for line in out.splitlines()[1:])
            if len(f) > 3 and f[3] == "0A"}
