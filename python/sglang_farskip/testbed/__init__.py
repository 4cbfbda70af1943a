"""What tests/ and bench/ share to run real things on one machine: free ports (ports), real
servers started and always killed (servers), two "nodes" in network namespaces joined by a veth
pair, shaped or not (netns). It drives a source checkout (deploy/entrypoint.sh, bench/ scripts):
REPO is the checkout this package sits in."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # the checkout: python/sglang_farskip/testbed/
