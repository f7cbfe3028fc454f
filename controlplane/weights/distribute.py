"""Spread verified weights over the nodes: one node gets them from here, the others copy node to node.

The first node receives the files from this machine once; then, round by round, every node that holds a
verified copy serves one node that does not, over SSH on the private network (a tree: 1 → 2 → 4 …
holders). Each target copies into ``.<digest>.partial`` next to the final directory, appending to any
partial file left by an interrupted copy, checks everything against the manifest sent from here
(``sha256sum --check``), re-fetches whole any file that fails, and only then renames the directory into
place: an engine never sees a partial or corrupted copy. Node-to-node SSH uses a key pair made for this one
distribution, authorised on the nodes for its duration only, and checks each source's host key: the keys
are read from every node over this machine's own SSH connection to it and handed to the targets as their
only known hosts, so a node on the private network answering in a source's place is refused.

Every peer works as root: the key goes into root's ``authorized_keys`` and nodes copy from each other as
root. Callers give a node reached as another user its copy some other way (``llmctl deploy`` copies to it
from here, like a single node).
"""

from __future__ import annotations

import shlex
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from controlplane.errors import WeightsError
from controlplane.weights import MANIFEST_NAME, read_manifest, sha256_file, verify_dir

if TYPE_CHECKING:
    from fabric import Connection

__all__ = ["Peer", "PeerCopy", "distribute", "verify_command"]

Progress = Callable[[str], None]
_TIMEOUT = 6 * 3600


@dataclass
class Peer:
    """One node to hold the weights: an open SSH connection and the address its peers reach it on."""

    name: str
    conn: Connection
    private_address: str
    ssh_port: int = 22
    ssh_user: str = "root"


@dataclass
class PeerCopy:
    """How one node got its copy."""

    node: str
    source: str
    """``here`` (this machine), another node's name, or ``present`` (already verified there)."""
    bytes_copied: int
    refetched: list[str]
    """Files that failed the manifest after copying (a corrupted partial) and were fetched again."""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _run(peer: Peer, command: str, *, check: bool = True, what: str | None = None) -> tuple[int, str]:
    """Run ``command`` on ``peer``; a failure (``check``) or a lost connection is a one-line
    :class:`WeightsError` naming the node and ``what`` was being done (default: the command's start)."""
    from invoke.exceptions import CommandTimedOut
    from paramiko import SSHException

    doing = what or f"`{command.splitlines()[0][:80]}`"
    try:
        result = peer.conn.run(command, hide=True, warn=True, in_stream=False, timeout=_TIMEOUT)
    except (CommandTimedOut, SSHException, OSError, EOFError) as exc:
        why = _last_line(str(exc)) if str(exc) else type(exc).__name__
        raise WeightsError(
            f"node {peer.name}: {doing} failed: SSH: {why}",
            hint=f"check that {peer.name} is up and reachable; nothing unverified was published",
        ) from None
    out = f"{result.stdout}{result.stderr}".strip()
    if check and result.return_code != 0:
        raise WeightsError(f"node {peer.name}: {doing} failed: {_last_line(out)}")
    return int(result.return_code), out


def _put(peer: Peer, local: Path, remote: PurePosixPath | str, what: str) -> None:
    from paramiko import SSHException

    try:
        peer.conn.put(str(local), str(remote))
    except (SSHException, OSError, EOFError) as exc:
        raise WeightsError(f"node {peer.name}: cannot copy {what}: {exc or type(exc).__name__}") from None


def verify_command(dest: PurePosixPath, manifest_sha256: str) -> str:
    """Shell that succeeds only when ``dest`` holds this manifest (by its hash) and every file matches it:
    a copy is checked against the manifest verified here, never only against one that came with it."""
    q = shlex.quote(str(dest))
    return (
        f"cd {q} && echo '{manifest_sha256}  {MANIFEST_NAME}' | sha256sum --check --status - "
        f"&& sha256sum --check --quiet {MANIFEST_NAME}"
    )


def _verified(peer: Peer, dest: PurePosixPath, manifest_sha256: str) -> bool:
    return _run(peer, verify_command(dest, manifest_sha256), check=False)[0] == 0


def _failed_files(peer: Peer, work: PurePosixPath) -> list[str]:
    """Files of ``work`` that do not match its manifest (empty: the copy is complete and correct)."""
    code, out = _run(
        peer,
        f"cd {shlex.quote(str(work))} && sha256sum --check --quiet {MANIFEST_NAME} 2>/dev/null",
        check=False,
    )
    if code == 0:
        return []
    return [
        line.rsplit(":", 1)[0]
        for line in out.splitlines()
        if line.endswith(("FAILED", "FAILED open or read"))
    ]


def _publish(peer: Peer, work: PurePosixPath, dest: PurePosixPath) -> None:
    qw, qd = shlex.quote(str(work)), shlex.quote(str(dest))
    # Weights are not secret and engines may run as another user: world-readable.
    _run(peer, f"chmod -R a+rX {qw} && rm -rf {qd} && mv -T {qw} {qd}")


def _partial(dest: PurePosixPath) -> PurePosixPath:
    return dest.with_name(f".{dest.name}.partial")


def _seed(peer: Peer, local: Path, files: dict[str, int], dest: PurePosixPath) -> int:
    work = _partial(dest)
    # Every directory in one command: a round trip per file adds up on a many-shard model.
    parents = sorted({str((work / name).parent) for name in files})
    _run(peer, "mkdir -p " + shlex.join(parents))
    copied = 0
    for name in sorted(files):
        _put(peer, local / name, work / name, name)
        copied += files[name]
    return copied


def _host_alias(peer: Peer) -> str:
    """The name a peer's host keys are known by on the targets (``HostKeyAlias``): not its address, which
    may be shared, forwarded or given with a port."""
    return f"sarv-peer-{peer.name}"


# The public halves of the keys sshd really uses (``sshd -T``), else the usual files.
_HOST_KEYS_COMMAND = (
    "keys=$(sshd -T 2>/dev/null | sed -n 's/^hostkey //p'); "
    'for k in ${keys:-/etc/ssh/ssh_host_*_key}; do [ -r "$k.pub" ] && cat "$k.pub"; done; true'
)


def _known_hosts(peers: Sequence[Peer]) -> str:
    """A known_hosts file naming each peer's host keys under its alias, read over this machine's SSH."""
    lines = []
    for peer in peers:
        _, out = _run(peer, _HOST_KEYS_COMMAND, what="reading its SSH host keys")
        keys = [line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2]
        if not keys:
            raise WeightsError(
                f"node {peer.name}: no SSH host key found (sshd -T hostkey, /etc/ssh/ssh_host_*_key.pub)",
                hint="node-to-node copies check the source's host key; make sshd's public host keys "
                "readable there, or give that node its copy from here",
            )
        lines += [f"{_host_alias(peer)} {kind} {key}" for kind, key in keys]
    return "\n".join(lines) + "\n"


def _pull_script(
    source: Peer, files: dict[str, int], src: PurePosixPath, work: PurePosixPath, key: str
) -> str:
    """Shell run on the target: append what each partial file lacks, from the source node, whose host key
    must be the one in ``<key>.known_hosts``."""
    ssh = shlex.join(
        [
            "ssh",
            "-i",
            key,
            "-p",
            str(source.ssh_port),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={key}.known_hosts",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            f"HostKeyAlias={_host_alias(source)}",
            "-o",
            "LogLevel=ERROR",
            f"{source.ssh_user}@{source.private_address}",
        ]
    )
    lines = ["set -eu"]
    for name, size in sorted(files.items()):
        f = shlex.quote(str(work / name))
        # Inside the double quotes $((have + 1)) expands here, the single-quoted path on the source.
        remote = f'"tail -c +$((have + 1)) {shlex.quote(str(src / name))}"'
        lines += [
            f"mkdir -p {shlex.quote(str((work / name).parent))}",
            f"have=$(stat -c %s {f} 2>/dev/null || echo 0)",
            f'if [ "$have" -gt {size} ]; then rm -f {f}; have=0; fi',
            f'if [ "$have" -lt {size} ]; then {ssh} {remote} >> {f}; echo "copied $(({size} - have))"; fi',
        ]
    return "\n".join(lines) + "\n"


def _pull(
    target: Peer, source: Peer, *, local: Path, files: dict[str, int], dest: PurePosixPath, key: str
) -> tuple[int, list[str]]:
    work = _partial(dest)
    # The manifest the copy is checked against goes from here, not from the source node: a node does not
    # vouch for the bytes it serves, and a corrupted manifest could not name the files to fetch again.
    _run(target, f"mkdir -p {shlex.quote(str(work))}")
    _put(target, local / MANIFEST_NAME, work / MANIFEST_NAME, MANIFEST_NAME)
    copied = files[MANIFEST_NAME]
    data = {name: size for name, size in files.items() if name != MANIFEST_NAME}
    refetched: list[str] = []
    for attempt in range(2):
        script = _pull_script(source, data, dest, work, key)
        _, out = _run(target, f"sh -c {shlex.quote(script)}", what=f"copy from {source.name}")
        copied += sum(int(line.split()[1]) for line in out.splitlines() if line.startswith("copied "))
        failed = _failed_files(target, work)
        if not failed:
            return copied, refetched
        if attempt == 1:
            break
        # A file that fails after the copy was a corrupted partial: fetch it again from the start.
        refetched += failed
        _run(target, "rm -f " + " ".join(shlex.quote(str(work / name)) for name in failed))
    raise WeightsError(
        f"node {target.name}: {', '.join(failed)} still fail the manifest "
        f"after a fresh copy from {source.name}",
        hint=f"check the disk of {target.name} and the copy on {source.name}; nothing was published",
    )


def distribute(
    local: Path,
    dest: PurePosixPath,
    peers: Sequence[Peer],
    *,
    progress: Progress | None = None,
    parallel: int = 8,
    tree: bool = True,
) -> list[PeerCopy]:
    """Give every peer a verified copy of ``local`` (a verified weights directory) at ``dest``.

    ``tree=False`` is the single-source baseline: every node copies from the first holder.
    """
    entries = read_manifest(local)
    verify_dir(local, entries)
    files = {name: (local / name).stat().st_size for name in entries} | {
        MANIFEST_NAME: (local / MANIFEST_NAME).stat().st_size
    }
    manifest_sha256 = sha256_file(local / MANIFEST_NAME)
    say = progress or (lambda _text: None)
    results: dict[str, PeerCopy] = {}
    holders: list[Peer] = []
    pending: list[Peer] = []
    for peer in peers:
        if _verified(peer, dest, manifest_sha256):
            say(f"weights: {peer.name}: already holds a verified copy")
            results[peer.name] = PeerCopy(peer.name, "present", 0, [])
            holders.append(peer)
        else:
            pending.append(peer)
    if pending and not holders:
        seed = pending.pop(0)
        say(f"weights: {seed.name}: copying from here ({sum(files.values())} bytes)")
        copied = _seed(seed, local, files, dest)
        failed = _failed_files(seed, _partial(dest))
        if failed:
            raise WeightsError(f"node {seed.name}: {', '.join(failed)} failed the manifest after the copy")
        _publish(seed, _partial(dest), dest)
        results[seed.name] = PeerCopy(seed.name, "here", copied, [])
        say(f"weights: {seed.name}: verified ({copied} bytes copied)")
        holders.append(seed)
    if pending:
        _spread(
            local=local,
            holders=holders,
            pending=pending,
            files=files,
            dest=dest,
            results=results,
            say=say,
            parallel=parallel,
            tree=tree,
        )
    return [results[p.name] for p in peers]


# The distribution's key appended to root's authorized_keys on its own line: a file whose last line has no
# newline would otherwise run that line and the key together, and removing the key by its tag afterwards
# would remove the line before it too (an operator's key).
_AUTHORIZE = (
    "mkdir -p -m 700 /root/.ssh && f=/root/.ssh/authorized_keys && "
    'if [ -s "$f" ] && [ -n "$(tail -c 1 "$f")" ]; then echo >> "$f"; fi && echo {pub} >> "$f"'
)


def _spread(
    *,
    local: Path,
    holders: list[Peer],
    pending: list[Peer],
    files: dict[str, int],
    dest: PurePosixPath,
    results: dict[str, PeerCopy],
    say: Progress,
    parallel: int,
    tree: bool,
) -> None:
    tag = f"sarv-weights-{uuid.uuid4().hex[:12]}"
    everyone = holders + pending
    with tempfile.TemporaryDirectory(prefix="sarv-weights-") as tmp:
        keyfile = Path(tmp) / "id_ed25519"
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", tag, "-f", str(keyfile)],
            check=True,
            timeout=60,
        )
        pub = keyfile.with_suffix(".pub").read_text().strip()
        known = Path(tmp) / "known_hosts"
        known.write_text(_known_hosts(everyone))
        remote_key = f"/root/.ssh/{tag}"
        try:
            for peer in everyone:
                _run(peer, _AUTHORIZE.format(pub=shlex.quote(pub)))
            for peer in pending:
                _put(peer, keyfile, remote_key, "the distribution's SSH key")
                _put(peer, known, f"{remote_key}.known_hosts", "the peers' host keys")
                _run(peer, f"chmod 600 {remote_key} {remote_key}.known_hosts")
            while pending:
                # A tree pairs each holder with one target per round; the baseline sends all from one.
                sources = holders if tree else holders[:1] * len(pending)
                pairs = list(zip(sources, pending, strict=False))
                pending = pending[len(pairs) :]

                def copy(pair: tuple[Peer, Peer]) -> Peer:
                    source, target = pair
                    say(f"weights: {target.name}: copying from {source.name}")
                    copied, refetched = _pull(
                        target, source, local=local, files=files, dest=dest, key=remote_key
                    )
                    _publish(target, _partial(dest), dest)
                    results[target.name] = PeerCopy(target.name, source.name, copied, refetched)
                    say(f"weights: {target.name}: verified ({copied} bytes copied)")
                    return target

                with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(pairs)))) as pool:
                    done = list(pool.map(copy, pairs))
                if tree:
                    holders += done
        finally:
            for peer in everyone:
                _run(
                    peer,
                    f"rm -f {remote_key} {remote_key}.known_hosts; "
                    f"sed -i '/ {tag}$/d' /root/.ssh/authorized_keys",
                    check=False,
                )
