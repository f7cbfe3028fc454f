"""`llmctl bundle load` onto three container hosts with no route out, node-to-node weight distribution, and
site.yml's plays and `llmctl deploy` converged from the loaded bundle alone.

The hosts lose their default route and their resolver before the load, so anything they install comes
from the bundle: the apt repository and wheelhouse served from the first host, the image through
`docker load` (the hosts share this machine's Docker daemon through its socket), the tiny model in every
node's cache, spread node to node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest
import yaml
from fixtures.ansible import ansible_env, tail, venv_tool
from fixtures.bundles import FAKE_PROVIDER, Kit, llmctl
from fixtures.common import REPO, need_binary
from fixtures.registry import Registry
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
    site_built: Path,
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
        "bundle", "load", str(site_built), "-i", str(inventory),
        "--allowed-signers", str(kit.allowed_signers), "--work", str(work),
        env={"SARV_SSH_KEY_FILE": str(hosts[0].key_path)},
    )  # fmt: skip
    yield Site(hosts, inventory, work, res)


def _no_way_out(hosts: list[TestHost]) -> None:
    for host in hosts:
        assert host.exec("ip route show default").stdout.strip() == ""
        assert host.exec("cat /etc/resolv.conf").stdout.strip() == ""
        assert host.exec("getent hosts deb.debian.org", check=False).returncode != 0


def test_load_publishes_every_part_and_nothing_outside_is_reached(site: Site, kit: Kit) -> None:
    assert site.load.returncode == 0, site.load.stderr
    node0, node1, _ = site.hosts
    url = f"http://{node0.ip}:8765"
    assert f"mirror: {url}" in site.load.stdout
    _no_way_out(site.hosts)

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


# What site.yml cannot converge in a container (as molecule/site switches it off: no GPU, no NVMe, no
# kernel tuning, no Docker-in-Docker), and node_exporter, whose package this bundle leaves out.
_SWITCHED_OFF = ("net_tuning", "nvme_raid", "nvidia_driver", "cuda", "nvidia_container_toolkit", "docker",
                 "dcgm_exporter", "node_exporter")  # fmt: skip


# Test-only, never in the role: chronyd without clock control (containers lack CAP_SYS_TIME).
_CHRONY_IN_A_CONTAINER = (
    "[Unit]\nConditionCapability=\n[Service]\nExecStart=\nExecStart=!/usr/sbin/chronyd -x\n"
)


_CONTROLLER_CACHE = "/var/lib/sarv/controller-models"


def test_load_pushes_images_to_the_site_registry_the_inventory_names(
    site: Site, kit: Kit, site_built: Path, site_registry: Registry, tmp_path: Path
) -> None:
    """With ``sarv_site_registry`` set, the image goes to that registry (digest kept) instead of to each
    node, and the roles' registry variables point at it."""
    assert site.load.returncode == 0, site.load.stderr
    inventory = tmp_path / "inventory" / "hosts.ini"
    inventory.parent.mkdir()
    text = site.inventory.read_text()
    assert "[all:vars]\n" in text
    registry_line = f"[all:vars]\nsarv_site_registry={site_registry.address}\n"
    inventory.write_text(text.replace("[all:vars]\n", registry_line))
    res = llmctl(
        "bundle", "load", str(site_built), "-i", str(inventory),
        "--allowed-signers", str(kit.allowed_signers), "--work", str(tmp_path / "unpacked"),
        # The mirror is already served by the first host; published here this time, to keep the test short.
        "--publish-dir", str(tmp_path / "mirror"), "--mirror-url", "http://mirror.invalid/sarv",
        env={"SARV_SSH_KEY_FILE": str(site.hosts[0].key_path)},
    )  # fmt: skip
    pushed = f"{site_registry.address}/{kit.image}"
    try:
        assert res.returncode == 0, res.stderr
    finally:
        subprocess.run(["docker", "rmi", pushed], capture_output=True, check=False)
    assert f"image {kit.image}: registry:{pushed}" in res.stdout
    repository, tag = kit.image.rsplit(":", 1)
    assert site_registry.tags(repository) == [tag]
    image_id = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Id}}", kit.image], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert site_registry.config_digest(repository, tag) == image_id
    gv = yaml.safe_load((inventory.parent / "group_vars/all/sarv_bundle.yml").read_text())
    assert gv["common_container_registry_mirror"] == site_registry.address
    assert gv["docker_registry_mirrors"] == [f"https://{site_registry.address}"]
    # The weights were already on every node: nothing copied again.
    for host in site.hosts:
        assert f"{host.name} from present" in res.stdout


def test_terraform_installs_the_bundles_providers_with_no_network(site: Site, tmp_path: Path) -> None:
    """The CLI config the load writes makes `terraform init` take the bundle's providers, in a network
    namespace with no interface up (so a registry lookup could only fail, never leave this machine)."""
    assert site.load.returncode == 0, site.load.stderr
    tfrc = site.work / "terraform.tfrc"
    assert f"terraform: export TF_CLI_CONFIG_FILE={tfrc}" in site.load.stdout
    terraform, unshare = need_binary("terraform"), need_binary("unshare")
    module = tmp_path / "module"
    module.mkdir()
    (module / "main.tf").write_text(
        "terraform {\n  required_providers {\n"
        f'    fake = {{ source = "{FAKE_PROVIDER}", version = "~> 1.0" }}\n'
        "  }\n}\n"
    )

    def init(*env: tuple[str, str]) -> subprocess.CompletedProcess[str]:
        argv = [unshare, "--net", terraform, f"-chdir={module}", "init", "-input=false", "-no-color"]
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "CHECKPOINT_DISABLE": "1", "TF_IN_AUTOMATION": "1", **dict(env)},
        )

    offline = init()  # the control: without the bundle's mirror there is nowhere to get it from
    assert offline.returncode != 0
    res = init(("TF_CLI_CONFIG_FILE", str(tfrc)))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    installed = module / ".terraform/providers" / FAKE_PROVIDER / "1.0.0/linux_amd64"
    assert (installed / "terraform-provider-fake_v1.0.0").is_file()
    assert FAKE_PROVIDER in (module / ".terraform.lock.hcl").read_text()


def _converge_inventory(site: Site) -> Path:
    """The site as Ansible sees it from here: every host a GPU node (so `common` runs on each) and in the
    controlplane group (Sarv's venv on each, for the `sim` engine); the controller and gateway run on the
    first host only. The state store is the role's default SQLite file (no redis group), and no monitoring
    group. The hosts are addressed by their private addresses, which the fleet inventory the role writes
    carries to the controller."""
    first = site.hosts[0].name
    gpu = {"sarv_gpu_model": "A100-SXM4-80GB", "sarv_gpu_count": 1, "sarv_gpu_memory_mib": 81920,
           "sarv_gpu_interconnect": "pcie"}  # fmt: skip
    gpu |= {f"sarv_enable_{role}": False for role in _SWITCHED_OFF}
    gpu["nvme_raid_devices"] = ["/dev/nvme-not-used-in-the-bundle-test"]  # see molecule/site/molecule.yml
    off = {"sarv_controlplane_gateway_enabled": False, "sarv_controlplane_controller_enabled": False}
    # The controller's own cache of verified weights, apart from the node cache on the same host, which
    # the load (and the SSH launcher) write as root.
    controller = {"sarv_controlplane_settings": {"model_cache": _CONTROLLER_CACHE}}
    roles = {h.name: controller if h.name == first else off for h in site.hosts}
    inventory = {
        "all": {
            "vars": {
                "ansible_user": "root",
                "preflight_required_groups": ["gpu_nodes", "controlplane"],
                "sarv_enable_node_exporter": False,
                # No NTP pool out there: chrony asks loopback (a site names its own servers).
                "common_ntp_servers": ["127.0.0.1"],
                "common_ntp_pools": [],
            },
            "children": {
                "gpu_nodes": {"hosts": {h.name: {"ansible_host": h.ip} for h in site.hosts}, "vars": gpu},
                "controlplane": {"hosts": roles},
            },
        }
    }
    path = site.inventory.parent / "converge.yml"  # beside the group_vars the load wrote
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path


def _replica_logs(site: Site) -> str:
    """The replicas' units and their journals on every host, and the controller's (for a failed deploy)."""
    out = []
    for host in site.hosts:
        res = host.exec(
            "systemctl list-units --no-legend --plain --all 'sarv-*'; "
            "journalctl -u 'sarv-sarv-tiny*' -u 'sarv-spread*' -u sarv-controller --no-pager | tail -40",
            check=False,
        )
        out.append(f"--- {host.name}\n{res.stdout[-3000:]}{res.stderr[-500:]}")
    return "\n".join(out)


def _as_sarv(host: TestHost, command: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``command`` as the role's service user, with the config the role wrote (llmctl of the role's venv)."""
    return host.exec(
        "runuser -u sarv -- env HOME=/var/lib/sarv SARV_CONFIG=/etc/sarv/config.yaml "
        f"PATH=/opt/sarv/venv/bin:/usr/bin:/bin {command}",
        check=False,
        timeout=timeout,
    )


@pytest.mark.timeout(1800)  # the module's bundle and load, then a full converge and a deploy
def test_site_plays_and_deploy_converge_from_the_bundle_alone(site: Site) -> None:
    assert site.load.returncode == 0, site.load.stderr
    _no_way_out(site.hosts)
    control, *_ = site.hosts
    for host in site.hosts:  # a container has no CAP_SYS_TIME: chronyd without clock control (-x)
        host.write_file("/etc/systemd/system/chrony.service.d/no-clock.conf", _CHRONY_IN_A_CONTAINER)
    inventory = _converge_inventory(site)
    log = inventory.with_suffix(".log")  # written as it runs: what a hung task was doing is there
    with log.open("w") as out:
        play = subprocess.run(
            [venv_tool("ansible-playbook"), "-i", str(inventory), "--private-key", str(control.key_path),
             str(REPO / "site.yml")],
            stdout=out, stderr=subprocess.STDOUT, timeout=1200, check=False, cwd=REPO,
            env=ansible_env(ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_ROLES_PATH=str(REPO / "roles")),
        )  # fmt: skip
    assert play.returncode == 0, tail(log.read_text(), 150)
    _no_way_out(site.hosts)

    url = f"http://{control.ip}:8765"
    for host in site.hosts:
        # common: apt from the bundle's mirror only, its packages in; the mirrors llmctl reads recorded.
        sources = host.exec("cat /etc/apt/sources.list; ls /etc/apt/sources.list.d").stdout
        assert f"deb {url}/debs bookworm main" in sources and "deb.debian.org" not in sources, sources
        host.exec("dpkg -s chrony jq pciutils python3-venv python3-packaging > /dev/null")
        assert f"SARV_MODEL_STORE_URL={url}/models" in host.exec("cat /etc/sarv/mirrors.env").stdout
        # sarv_controlplane: Sarv from the bundle's wheelhouse, the wheel built from this checkout.
        assert host.exec("/opt/sarv/venv/bin/llmctl --version").stdout.strip()
    pip = control.exec("/opt/sarv/venv/bin/pip list --format json").stdout
    assert "sarv" in {d["name"] for d in json.loads(pip)}
    assert control.exec("systemctl is-active sarv-controller sarv-gateway").stdout.split() == ["active"] * 2
    for host in site.hosts[1:]:
        assert host.exec("systemctl is-active sarv-gateway", check=False).stdout.strip() != "active"

    # The controller reaches the nodes over SSH as root with the site's key (what an operator installs).
    control.exec("install -d -o sarv -g sarv -m 0700 /var/lib/sarv/.ssh")
    control.write_file("/var/lib/sarv/.ssh/id_ed25519", control.key_path.read_text(), mode="0600")
    control.exec("chown sarv:sarv /var/lib/sarv/.ssh/id_ed25519")
    since = control.exec("date '+%Y-%m-%d %H:%M:%S'").stdout.strip()
    deploy = _as_sarv(control, "llmctl deploy sarv-tiny --engine sim --timeout 300")
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:] + _replica_logs(site)
    status = _as_sarv(control, "llmctl status -o json")
    assert status.returncode == 0, status.stderr
    [dep] = [d for d in json.loads(status.stdout)["deployments"] if d["name"] == "sarv-tiny"]
    assert {r["state"] for r in dep["replicas"]} == {"ready"}
    assert len(dep["replicas"]) == 1 and dep["replicas"][0]["node"] in {h.name for h in site.hosts}
    # The weights came from the model store the load published (its access log), not generated here.
    served = control.exec(f"journalctl -u sarv-bundle-mirror --since '{since}' --no-pager").stdout
    assert "GET /models/sarv-tiny/none/" in served, served[-2000:]
    assert control.exec(f"test -e {_CONTROLLER_CACHE}/_generated", check=False).returncode != 0

    created = _as_sarv(control, "llmctl keys create converge -o json")
    assert created.returncode == 0, created.stderr
    key = json.loads(created.stdout)["key"]
    chat = {"model": "sarv-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = f"-H 'Authorization: Bearer {key}' -H 'Content-Type: application/json'"
    answer = control.exec(
        # The gateway picks the new deployment up from the state store within seconds: 60 tries, 1 s apart.
        f"for i in $(seq 60); do curl -sf {headers} -d '{json.dumps(chat)}' "
        "http://127.0.0.1:8080/v1/chat/completions && exit 0; sleep 1; done; exit 1",
        check=False,
        timeout=120,
    )
    assert answer.returncode == 0, answer.stdout[-2000:] + answer.stderr[-2000:]
    assert json.loads(answer.stdout)["choices"][0]["message"]["content"]
    undeploy = _as_sarv(control, "llmctl undeploy sarv-tiny --yes")
    assert undeploy.returncode == 0, undeploy.stderr
    _no_way_out(site.hosts)


def test_replicas_of_a_converged_site_spread_over_its_nodes(site: Site) -> None:
    """After the converge above (same module hosts): two replicas, each on its own node."""
    control = site.hosts[0]
    assert control.exec("test -x /opt/sarv/venv/bin/llmctl", check=False).returncode == 0, (
        "needs test_site_plays_and_deploy_converge_from_the_bundle_alone to have converged the hosts"
    )
    deploy = _as_sarv(
        control, "llmctl deploy sarv-tiny --name spread --engine sim --replicas 2 --timeout 240"
    )
    try:
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:] + _replica_logs(site)
        status = json.loads(_as_sarv(control, "llmctl status -o json").stdout)
        [dep] = [d for d in status["deployments"] if d["name"] == "spread"]
        assert {r["state"] for r in dep["replicas"]} == {"ready"}
        assert len({r["node"] for r in dep["replicas"]}) == 2
    finally:
        _as_sarv(control, "llmctl undeploy spread --yes")
    _no_way_out(site.hosts)
