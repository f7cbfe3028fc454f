"""The test VMs' private network as this machine joins it (tests/fixtures/l2hub.py), without a VM: the
namespace and its hub come and go with the fixture, and a namespace left by a test process that was killed
before it could remove its own (SIGKILL leaves no chance) is removed by the next one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from fixtures.common import need, need_binary
from fixtures.l2hub import ADDRESS, namespaces, private_network


def test_a_killed_processs_namespace_is_removed_a_live_ones_kept_and_the_new_one_goes_on_leaving() -> None:
    need(os.geteuid() == 0, "network namespaces need root")
    need(Path("/dev/net/tun").exists(), "no /dev/net/tun for the hub's TAP device")
    need_binary("ip")
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = f"sarv-pn-{gone.pid}-0000dead"  # its process no longer runs
    live = f"sarv-pn-{os.getpid()}-0000beef"  # this process runs: another fixture's, in use
    for name in (left, live):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        with private_network() as net:
            names = namespaces()
            assert left not in names
            assert live in names
            assert net.namespace in names and net.namespace.startswith(f"sarv-pn-{os.getpid()}-")
            addr = subprocess.run(
                net.argv(["ip", "-4", "-o", "addr", "show", "tap0"]),
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout
            assert f"inet {ADDRESS}/24" in addr
        assert net.namespace not in namespaces()
        assert net.proc.poll() is not None  # the hub ended with it
    finally:
        for name in (left, live):
            subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)
