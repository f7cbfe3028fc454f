"""`llmctl deploy` onto three remote hosts spreads the weights node to node: one copy leaves this machine.

One module-scoped deploy (the ``sim`` engine with the generated ``sarv-tiny``, a replica per host) is shared
by the assertions on its progress output, the hosts' caches and the replicas; a second deploy then finds
the copies and moves nothing, and a third finds a copy altered together with its manifest and replaces it.
Two last deploys, each into another cache, must fail, name the node, publish nothing there and roll back:
one meets a node-to-node copy that arrives corrupted every time, the other sources whose host keys are not
the ones read from them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fixtures.testhosts import TestHost, checkout_volumes
from fixtures.vllm import LlmctlEnv

from controlplane.spec import Fleet, Node
from controlplane.weights import MANIFEST_NAME, cache_digest, read_manifest, sha256_file

pytestmark = [pytest.mark.ssh, pytest.mark.docker, pytest.mark.slow]

_QUERY = "0, GPU-00000002-aaaa-bbbb-cccc-000000000000, NVIDIA L4, 23034, 0, 00000000:01:00.0\n"
_COPYING = re.compile(r"weights: (\S+): copying from (\S+)")
_VERIFIED = re.compile(r"weights: (\S+): verified \((\d+) bytes copied\)")
_PRESENT = re.compile(r"weights: (\S+): already holds a verified copy")


@dataclass
class Spread:
    cli: LlmctlEnv
    hosts: list[TestHost]
    cache: str
    """The remote model cache of this module (its own, so no earlier test's copy is found there)."""
    progress: list[str]
    """stderr of the first deploy: without a terminal, one ``… text`` line per change."""
    local: Path
    """The generated model the deploy verified here."""

    def model_dir(self, cache: str | None = None) -> str:
        return f"{cache or self.cache}/sarv-tiny/{cache_digest(read_manifest(self.local))}"


@pytest.fixture(scope="module")
def spread_hosts(
    remote_hosts: list[TestHost], testhost_factory: Callable[..., list[TestHost]]
) -> list[TestHost]:
    """The two remote hosts and a third made like them."""
    [third] = testhost_factory(1, prefix="spread", volumes=checkout_volumes())
    third.exec("chmod 0711 /root")  # as in conftest: the dynamic unit user reaches the interpreter
    third.set_fake_gpus(_QUERY)
    return [*remote_hosts, third]


@pytest.fixture(scope="module")
def spread(tmp_path_factory: pytest.TempPathFactory, spread_hosts: list[TestHost]) -> Iterator[Spread]:
    tmp = tmp_path_factory.mktemp("spread")
    nodes = [
        Node(name=h.name, address=h.address, ssh_port=h.ssh_port, ssh_user=h.user, nic="eth0")
        for h in spread_hosts
    ]
    (tmp / "fleet.json").write_text(Fleet(nodes=nodes).model_dump_json())
    cli = LlmctlEnv.create(tmp / "home")
    cache = f"/var/lib/sarv/models-spread-{uuid.uuid4().hex[:8]}"
    cli.env |= {
        "SARV_INVENTORY": str(tmp / "fleet.json"),
        "SARV_REMOTE_PYTHON": sys.executable,
        "SARV_SSH_KEY_FILE": str(spread_hosts[0].key_path),
        "SARV_REMOTE_MODEL_CACHE": cache,
    }
    deployed = cli.llmctl(
        "deploy", "sarv-tiny", "--name", "spread-a", "--engine", "sim", "--replicas", "3", timeout=300
    )
    try:
        assert deployed.returncode == 0, deployed.stderr
        yield Spread(
            cli=cli,
            hosts=spread_hosts,
            cache=cache,
            progress=deployed.stderr.splitlines(),
            local=tmp / "home" / "models" / "_generated" / "sarv-tiny",
        )
    finally:
        for name in ("spread-a", "spread-b", "spread-c", "spread-nl"):
            cli.llmctl("undeploy", name, timeout=120)
        for h in spread_hosts:
            left = h.exec("ls /etc/systemd/system | grep '^sarv-spread' || true").stdout.split()
            assert not left, f"units left on {h.name}: {left}"
            h.exec(f"rm -rf {cache}*")


def _model_bytes(local: Path) -> int:
    """What one full copy moves: every file of the manifest and the manifest itself."""
    return sum((local / name).stat().st_size for name in [*read_manifest(local), MANIFEST_NAME])


def test_one_node_copies_from_here_the_others_from_nodes(spread: Spread) -> None:
    names = {h.name for h in spread.hosts}
    sources = dict(m.groups() for line in spread.progress if (m := _COPYING.search(line)))
    assert set(sources) == names, spread.progress
    [seed] = [node for node, source in sources.items() if source.startswith("here")]
    for node, source in sources.items():
        if node != seed:
            # A node that already held a verified copy serves it on the private network.
            assert source in names - {node}, (node, source)
    verified = {m.group(1): int(m.group(2)) for line in spread.progress if (m := _VERIFIED.search(line))}
    # Every node moved exactly one full copy: nothing twice, nothing partial.
    assert verified == dict.fromkeys(names, _model_bytes(spread.local)), spread.progress
    # The star path (one copy from here per node) was not taken.
    assert not [line for line in spread.progress if "weights: copying sarv-tiny to" in line]


def test_the_documented_progress_is_what_a_deploy_prints(spread: Spread) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "remote.md").read_text()
    block = re.search(r"### Weights for several nodes.*?```text\n(.*?)```", doc, re.S)
    assert block is not None
    # The docs' nodes gpu-0 (the seed), gpu-1, gpu-2 are this deploy's nodes in the order they copied.
    order = list(dict.fromkeys(m.group(1) for line in spread.progress if (m := _COPYING.search(line))))
    size = str(_model_bytes(spread.local))
    documented = block.group(1).replace("5797962", size).splitlines()
    for i, node in enumerate(order):
        documented = [line.replace(f"gpu-{i}", node) for line in documented]
    printed = iter(spread.progress)
    # In this order, each line among what the deploy printed (other lines may come between).
    assert all(any(line == said for said in printed) for line in documented), (documented, spread.progress)


def test_every_node_holds_a_copy_that_passes_its_manifest(spread: Spread) -> None:
    for h in spread.hosts:
        check = h.exec(f"cd {spread.model_dir()} && sha256sum --check --quiet {MANIFEST_NAME}", check=False)
        assert check.returncode == 0, (h.name, check.stdout, check.stderr)
        # Only the published copy: no partial directory left, no second digest.
        listed = h.exec(f"ls -A {spread.cache}/sarv-tiny").stdout.split()
        assert listed == [spread.model_dir().rsplit("/", 1)[1]], (h.name, listed)


def test_the_replicas_serve_from_the_spread_copies(spread: Spread) -> None:
    status = spread.cli.llmctl("status", "-o", "json")
    assert status.returncode == 0, status.stderr
    [dep] = [d for d in json.loads(status.stdout)["deployments"] if d["name"] == "spread-a"]
    replicas = dep["replicas"]
    assert sorted(r["node"] for r in replicas) == sorted(h.name for h in spread.hosts)
    assert {r["state"] for r in replicas} == {"ready"}
    key = spread.cli.engine_key("spread-a")
    assert key
    for r in replicas:
        host = next(h for h in spread.hosts if h.name == r["node"])
        url = f"http://{host.ip}:{r['endpoint'].rsplit(':', 1)[1]}/v1/models"
        auth = f"Authorization: Bearer {key}"  # a throwaway test host: argv is fine here
        models = host.exec(f"curl -sf -H '{auth}' {url}", check=False).stdout
        assert "spread-a" in models, (r["node"], models)


def test_a_second_deploy_finds_the_copies_and_copies_nothing(spread: Spread) -> None:
    inode = f"stat -c %i {spread.model_dir()}"
    before = {h.name: h.exec(inode).stdout.strip() for h in spread.hosts}
    again = spread.cli.llmctl(
        "deploy", "sarv-tiny", "--name", "spread-b", "--engine", "sim", "--replicas", "3", timeout=300
    )
    assert again.returncode == 0, again.stderr
    lines = again.stderr.splitlines()
    present = {m.group(1) for line in lines if (m := _PRESENT.search(line))}
    assert present == {h.name for h in spread.hosts}, lines
    assert not [line for line in lines if _COPYING.search(line) or "weights: copying" in line], lines
    # The same directories: nothing was copied and renamed into place again.
    assert {h.name: h.exec(inode).stdout.strip() for h in spread.hosts} == before


def test_a_copy_altered_with_its_manifest_is_not_taken_for_a_verified_one(spread: Spread) -> None:
    host = spread.hosts[-1]  # the third host, last by name (its number depends on the session's other hosts)
    model_dir = spread.model_dir()
    # Changed bytes and a manifest rewritten to match them: consistent, but not the manifest verified here.
    host.exec(
        f"cd {model_dir} && echo '{{}}' > generation_config.json && "
        f"sha256sum $(awk '{{print $2}}' {MANIFEST_NAME}) > {MANIFEST_NAME}.new && "
        f"mv {MANIFEST_NAME}.new {MANIFEST_NAME} && sha256sum --check --quiet {MANIFEST_NAME}"
    )
    again = spread.cli.llmctl(
        "deploy", "sarv-tiny", "--name", "spread-c", "--engine", "sim", "--replicas", "3", timeout=300
    )
    assert again.returncode == 0, again.stderr
    lines = again.stderr.splitlines()
    present = {m.group(1) for line in lines if (m := _PRESENT.search(line))}
    assert present == {h.name for h in spread.hosts} - {host.name}, lines
    sources = dict(m.groups() for line in lines if (m := _COPYING.search(line)))
    assert sources.keys() == {host.name} and sources[host.name] in present, lines
    manifest = host.exec(f"sha256sum {model_dir}/{MANIFEST_NAME}").stdout.split()[0]
    assert manifest == sha256_file(spread.local / MANIFEST_NAME)
    host.exec(f"cd {model_dir} && sha256sum --check --quiet {MANIFEST_NAME}")


def _deploy_then_undo(spread: Spread, cache: str, name: str, undo: str) -> subprocess.CompletedProcess[str]:
    """``llmctl deploy`` of three sim replicas into ``cache``, then ``undo`` run on every host however
    the deploy ended."""
    try:
        cli = LlmctlEnv(home=spread.cli.home, env={**spread.cli.env, "SARV_REMOTE_MODEL_CACHE": cache})
        return cli.llmctl(
            "deploy", "sarv-tiny", "--name", name, "--engine", "sim", "--replicas", "3", timeout=300
        )
    finally:
        for h in spread.hosts:
            h.exec(undo)


def test_a_copy_corrupted_on_the_way_fails_the_deploy_and_is_never_used(spread: Spread) -> None:
    cache = f"{spread.cache}-corrupt"
    # Every node-to-node copy arrives altered (the nodes' ssh client is shadowed); the seed's copy from
    # here goes over SFTP and arrives intact.
    shadow = '#!/bin/sh\n/usr/bin/ssh "$@" | tr a b\n'
    for h in spread.hosts:
        h.write_file("/usr/local/bin/ssh", shadow, mode="0755")
    failed = _deploy_then_undo(spread, cache, "spread-bad", undo="rm -f /usr/local/bin/ssh")
    assert failed.returncode == 6, failed.stderr
    assert "Traceback" not in failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    said = r"error: node (\S+): .* still fail the manifest after a fresh copy from ([\w.-]+);"
    match = re.search(said, last)
    assert match, last
    assert "the deploy was rolled back" in last
    bad, seed = match.groups()
    # The manifest went from here: the files it names are the real ones, each fetched twice.
    assert "model.safetensors" in last
    names = {h.name for h in spread.hosts}
    assert bad in names and seed in names - {bad}
    model_dir = spread.model_dir(cache)
    for h in spread.hosts:
        published = h.exec(f"test -e {model_dir}", check=False).returncode == 0
        # Only the seed, whose copy from here passed its manifest, holds a published copy.
        assert published == (h.name == seed), h.name
        units = h.exec("ls /etc/systemd/system | grep '^sarv-spread-bad' || true").stdout.split()
        assert not units, (h.name, units)
    status = spread.cli.llmctl("status", "-o", "json")
    assert "spread-bad" not in {d["name"] for d in json.loads(status.stdout)["deployments"]}


def test_a_source_whose_host_key_is_not_the_one_read_is_refused(spread: Spread) -> None:
    """Node-to-node copies check the source's host key against the keys read from each node over this
    machine's SSH. Here every node's public host key files are replaced by another key's (sshd still
    serves its own): to the targets, each source now answers with a key that is not the one on record,
    as a machine answering in its place on the private network would, and no copy is made."""
    cache = f"{spread.cache}-hostkey"
    save = "for f in /etc/ssh/ssh_host_*_key.pub; do cp -p $f $f.sarv-test; done"
    forge = (
        "rm -f /tmp/other && ssh-keygen -q -t ed25519 -N '' -f /tmp/other && "
        "for f in /etc/ssh/ssh_host_*_key.pub; do cp /tmp/other.pub $f; done"
    )
    restore = (
        "for f in /etc/ssh/ssh_host_*_key.pub.sarv-test; do mv $f ${f%.sarv-test}; done; rm -f /tmp/other*"
    )
    for h in spread.hosts:
        h.exec(f"{save} && {forge}")
    failed = _deploy_then_undo(spread, cache, "spread-key", undo=restore)
    assert failed.returncode == 6, failed.stderr
    assert "Traceback" not in failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    match = re.search(r"error: node (\S+): copy from ([\w.-]+) failed: .*Host key verification failed", last)
    assert match, last
    assert "the deploy was rolled back" in last
    _, seed = match.groups()
    model_dir = spread.model_dir(cache)
    for h in spread.hosts:
        published = h.exec(f"test -e {model_dir}", check=False).returncode == 0
        assert published == (h.name == seed), h.name
        # The distribution's key and the host keys it handed out are gone.
        assert not h.exec("ls /root/.ssh | grep '^sarv-weights-' || true").stdout.split(), h.name


def test_an_authorized_keys_file_without_a_final_newline_keeps_its_last_key(spread: Spread) -> None:
    """A node whose root ``authorized_keys`` ends without a newline (a hand-edited file): the distribution's
    key goes on a line of its own, so the node-to-node copies authenticate with it, and removing it
    afterwards leaves the operator's key in place."""
    keys = "/root/.ssh/authorized_keys"
    before = {h.name: h.exec(f"cat {keys}").stdout for h in spread.hosts}
    cli = LlmctlEnv(
        home=spread.cli.home, env={**spread.cli.env, "SARV_REMOTE_MODEL_CACHE": f"{spread.cache}-nl"}
    )
    try:
        for h in spread.hosts:
            h.exec(f"cp -p {keys} {keys}.sarv-test && printf '%s' \"$(cat {keys}.sarv-test)\" > {keys}")
        deployed = cli.llmctl(
            "deploy", "sarv-tiny", "--name", "spread-nl", "--engine", "sim", "--replicas", "3", timeout=300
        )
        assert deployed.returncode == 0, deployed.stderr
        sources = dict(m.groups() for line in deployed.stderr.splitlines() if (m := _COPYING.search(line)))
        assert [s for s in sources.values() if not s.startswith("here")], deployed.stderr  # node to node
        for h in spread.hosts:
            # The operator's lines are all there, each whole; the distribution's key is gone.
            assert h.exec(f"cat {keys}").stdout == before[h.name], h.name
    finally:
        cli.llmctl("undeploy", "spread-nl", timeout=120)
        for h in spread.hosts:
            h.exec(f"mv {keys}.sarv-test {keys}")
