"""Weight distribution to N container hosts: node-to-node tree against the single-source baseline.

Each host's egress is limited with `tc` (a token bucket, --rate-mbit) so the hosts behave like nodes behind
their own NICs rather than processes sharing one machine's memory bandwidth. One host is seeded first; then
the same weights directory is spread to the other N-1 twice in the same run: every node copying from the
seed (baseline), and by `controlplane.weights.distribute` (tree: each verified holder serves one node per
round). Results: bench/bundle/results/distribute.json (seconds per mode and their ratio).

    python bench/bundle/distribute.py [--nodes 6] [--size-mib 32] [--rate-mbit 40]

Needs Docker and the test-host image (scripts/testbed-image).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from fixtures.testhosts import IMAGE, TestHostPool  # noqa: E402

from controlplane.remote import FabricConnector  # noqa: E402
from controlplane.spec import Node  # noqa: E402
from controlplane.weights import cache_digest, read_manifest, write_manifest  # noqa: E402
from controlplane.weights.distribute import Peer, distribute  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--size-mib", type=int, default=32)
    ap.add_argument("--rate-mbit", type=int, default=40)
    args = ap.parse_args()
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, check=False).returncode:
        print(f"error: image {IMAGE} missing; build it with scripts/testbed-image", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="sarv-bench-dist-") as tmp:
        key = Path(tmp) / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        weights = Path(tmp) / "weights"
        weights.mkdir()
        (weights / "model.safetensors").write_bytes(os.urandom(args.size_mib << 20))
        write_manifest(weights)
        dest = PurePosixPath("/var/lib/sarv/bench") / cache_digest(read_manifest(weights))
        pool = TestHostPool(key, key.with_suffix(".pub").read_text())
        try:
            hosts = pool.make(args.nodes, prefix="dist", cap_add=("SYS_ADMIN", "NET_ADMIN"))
            for h in hosts:
                h.exec(f"tc qdisc add dev eth0 root tbf rate {args.rate_mbit}mbit burst 256kb latency 100ms")
            connector = FabricConnector(key_filename=key)
            peers = [
                Peer(h.name, connector.connection(Node(name=h.name, address="127.0.0.1", ssh_port=h.ssh_port,
                                                       ssh_user="root"), connect_timeout=10), h.ip)
                for h in hosts
            ]  # fmt: skip
            distribute(weights, dest, peers[:1])  # the seed, the same for both modes
            seconds: dict[str, float] = {}
            for mode, tree in (("single_source", False), ("tree", True)):
                for h in hosts[1:]:
                    h.exec(f"rm -rf {dest.parent}")
                t0 = time.perf_counter()
                copies = distribute(weights, dest, peers, tree=tree)
                seconds[mode] = round(time.perf_counter() - t0, 2)
                assert all(c.source != "here" for c in copies)
                print(f"{mode}: {seconds[mode]} s  " + ", ".join(f"{c.node}<-{c.source}" for c in copies))
            for p in peers:
                p.conn.close()
        finally:
            pool.close()
    result = {
        "nodes": args.nodes,
        "size_mib": args.size_mib,
        "rate_mbit_per_node": args.rate_mbit,
        "seconds": seconds,
        "tree_over_single_source": round(seconds["tree"] / seconds["single_source"], 3),
    }
    out = REPO / "bench" / "bundle" / "results" / "distribute.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
