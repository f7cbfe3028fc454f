"""`llmctl bundle load` onto three container hosts with no route out, and node-to-node weight distribution.

The hosts lose their default route and their resolver before the load, so anything they install comes
from the bundle: the apt repository and wheelhouse served from the first host, the image through
`docker load` (the hosts share this machine's Docker daemon through its socket), the tiny model in every
node's cache, spread node to node.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest
import yaml
from fixtures.bundles import Kit, llmctl
from fixtures.testhosts import TestHost

from controlplane.remote import FabricConnector
from controlplane.settings import load_settings
from controlplane.spec import Node
from controlplane.weights import cache_digest, ensure_weights, read_manifest
from controlplane.weights.distribute import Peer, distribute

pytestmark = [pytest.mark.docker, pytest.mark.ssh, pytest.mark.slow]

TINY = "models/sarv-tiny/none"


@dataclass
class Site:
    hosts: list[TestHost]
    inventory: Path
    work: Path
    load: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def site(
    testhost_factory: Callable[..., list[TestHost]],
    kit: Kit,
    built: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Site]:
    docker = shutil.which("docker")
    assert docker is not None
    hosts = testhost_factory(
        3,
        prefix="bundle",
        cap_add=("SYS_ADMIN", "NET_ADMIN"),
        volumes=("/var/run/docker.sock:/var/run/docker.sock", f"{docker}:/usr/local/bin/docker:ro"),
    )
    for host in hosts:  # no way out: no default route, no resolver
        host.exec("ip route del default && : > /etc/resolv.conf")
    root = tmp_path_factory.mktemp("site")
    inventory = root / "inventory" / "hosts.ini"
    inventory.parent.mkdir()
    lines = [
        f"{h.name} ansible_host=127.0.0.1 ansible_port={h.ssh_port} sarv_private_address={h.ip}"
        for h in hosts
    ]
    inventory.write_text(
        f"[controlplane]\n{lines[0]}\n\n[gpu_nodes]\n" + "\n".join(lines) + "\n\n[gpu_nodes:vars]\n"
        "sarv_gpu_model=A100-SXM4-80GB\nsarv_gpu_count=1\nsarv_gpu_memory_mib=81920\n\n"
        "[all:vars]\nansible_user=root\n"
    )
    # The image must come back from the bundle: drop it here first.
    subprocess.run(["docker", "rmi", kit.image], capture_output=True, check=True)
    work = root / "unpacked"
    res = llmctl(
        "bundle", "load", str(built), "-i", str(inventory), "--allowed-signers", str(kit.allowed_signers),
        "--work", str(work), env={"SARV_SSH_KEY_FILE": str(hosts[0].key_path)},
    )  # fmt: skip
    yield Site(hosts, inventory, work, res)


def test_load_publishes_every_part_and_nothing_outside_is_reached(site: Site, kit: Kit) -> None:
    assert site.load.returncode == 0, site.load.stderr
    node0, node1, _ = site.hosts
    url = f"http://{node0.ip}:8765"
    assert f"mirror: {url}" in site.load.stdout
    for host in site.hosts:
        assert host.exec("ip route show default").stdout.strip() == ""
        assert host.exec("getent hosts deb.debian.org", check=False).returncode != 0

    gv = yaml.safe_load((site.inventory.parent / "group_vars/all/sarv_bundle.yml").read_text())
    assert gv["common_apt_mirror"] == f"{url}/debs"
    assert gv["common_model_store_url"] == f"{url}/models"
    assert Path(gv["sarv_controlplane_wheelhouse"], "sarvtest_b-2.0-py3-none-any.whl").is_file()

    # apt, as the common role configures it from these variables (roles/common/templates/sources.list.j2).
    mirror, release = gv["common_apt_mirror"], "bookworm"
    node1.write_file(
        "/etc/apt/sources.list", f"deb {mirror} {release} main\ndeb {mirror} {release}-updates main\n"
    )
    node1.exec("rm -f /etc/apt/sources.list.d/*")
    apt = node1.exec(
        "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
        "python3-venv",
        check=False,
        timeout=300,
    )
    assert apt.returncode == 0, apt.stdout[-2000:] + apt.stderr[-2000:]
    pip = node1.exec(
        f"python3 -m venv /opt/v && /opt/v/bin/pip install -q --no-index --find-links {url}/wheels/ "
        f"--trusted-host {node0.ip} sarvtest-b"
        " && /opt/v/bin/python -c 'import sarvtest_a, sarvtest_b; print(sarvtest_b.VERSION)'",
        check=False,
        timeout=300,
    )
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    assert pip.stdout.strip().endswith("2.0")

    # docker load on every GPU node (one daemon here, so the image is back once each node loaded it).
    assert f"image {kit.image}: bundle-0, bundle-1, bundle-2" in site.load.stdout
    assert node1.exec(f"docker image inspect -f '{{{{.Id}}}}' {kit.image}").stdout.startswith("sha256:")

    # Weights: one copy from here, the rest node to node, each verified in the cache.
    digest = cache_digest(read_manifest(site.work / TINY))
    for host in site.hosts:
        host.exec(f"cd /var/lib/sarv/models/sarv-tiny/{digest} && sha256sum --check --quiet SHA256SUMS")
    assert "bundle-0 from here" in site.load.stdout
    assert "bundle-1 from bundle-0" in site.load.stdout


def test_llmctl_takes_weights_from_the_model_store_the_common_role_records(
    site: Site, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert site.load.returncode == 0, site.load.stderr
    gv = yaml.safe_load((site.inventory.parent / "group_vars/all/sarv_bundle.yml").read_text())
    # What roles/common/templates/mirrors.env.j2 renders from the group_vars.
    mirrors = tmp_path / "mirrors.env"
    mirrors.write_text(
        f"SARV_PYPI_INDEX_URL=\nSARV_REGISTRY_MIRROR=\nSARV_MODEL_STORE_URL={gv['common_model_store_url']}\n"
    )
    monkeypatch.setenv("SARV_MIRRORS_ENV", str(mirrors))
    settings = load_settings()
    assert settings.model_store_url == gv["common_model_store_url"]
    landed = ensure_weights(f"{settings.model_store_url}/sarv-tiny/none", "sarv-tiny", tmp_path / "cache")
    assert landed.name == cache_digest(read_manifest(site.work / TINY))


def test_distribution_resumes_an_interrupted_copy_and_refetches_a_corrupted_one(site: Site) -> None:
    assert site.load.returncode == 0, site.load.stderr
    local = site.work / TINY
    weights = local / "model.safetensors"
    size = weights.stat().st_size
    half = size // 2
    dest = PurePosixPath("/var/lib/sarv/dist-test") / cache_digest(read_manifest(local))
    partial = dest.with_name(f".{dest.name}.partial")
    node0, node1, node2 = site.hosts
    for host in site.hosts:
        host.exec("rm -rf /var/lib/sarv/dist-test")
    # node-1: a copy interrupted halfway (the first half, correct); node-2: a finished copy with one
    # byte flipped, and a partial one whose first half is wrong.
    node1.exec(f"mkdir -p {partial}")
    subprocess.run(
        ["docker", "exec", "-i", node1.container, "sh", "-c", f"cat > {partial}/model.safetensors"],
        input=weights.read_bytes()[:half],
        check=True,
    )
    node2.exec(f"mkdir -p {dest.parent}")
    subprocess.run(["docker", "cp", str(local), f"{node2.container}:{dest}"], check=True)
    node2.exec(f"printf 'X' | dd of={dest}/model.safetensors bs=1 seek=100 conv=notrunc status=none")
    node2.exec(f"mkdir -p {partial} && head -c {half} /dev/zero > {partial}/model.safetensors")

    connector = FabricConnector(key_filename=node0.key_path)
    peers = []
    for host in site.hosts:
        node = Node(name=host.name, address="127.0.0.1", ssh_port=host.ssh_port, ssh_user="root")
        peers.append(Peer(host.name, connector.connection(node, connect_timeout=10), host.ip))
    said: list[str] = []
    try:
        copies = distribute(local, dest, peers, progress=said.append)
    finally:
        for p in peers:
            p.conn.close()
    by = {c.node: c for c in copies}
    assert by["bundle-0"].source == "here"
    assert by["bundle-1"].source == "bundle-0"
    assert by["bundle-1"].bytes_copied < sum(f.stat().st_size for f in local.iterdir())  # resumed
    assert by["bundle-1"].refetched == []
    assert by["bundle-2"].refetched == ["model.safetensors"]
    for host in site.hosts:
        host.exec(f"cd {dest} && sha256sum --check --quiet SHA256SUMS")
        assert host.exec(f"ls -a {dest.parent}").stdout.split() == [".", "..", dest.name]
        # The distribution's key pair is gone again.
        assert "sarv-weights-" not in host.exec("cat /root/.ssh/authorized_keys; ls /root/.ssh").stdout
    assert any("bundle-2: copying from" in line for line in said)
