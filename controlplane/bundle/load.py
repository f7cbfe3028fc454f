"""``llmctl bundle load``: verify a bundle, then publish each part where the site consumes it.

- the apt repository, the wheelhouse, the model store, dashboards and Terraform providers: one mirror
  tree, copied to a directory on the serving node (the first host of the ``controlplane`` group unless
  told otherwise) and served there over HTTP by a systemd unit, or written to a local path;
- the repository's signing key: trusted by apt on every host (``/etc/apt/trusted.gpg.d/``);
- container images: ``docker load`` on every GPU node over SSH, or pushed to the site registry when the
  inventory names one (``sarv_site_registry``);
- weights: into every GPU node's model cache, one copy from here and the rest node to node
  (:mod:`controlplane.weights.distribute`);
- the mirror variables of the roles: ``group_vars/all/sarv_bundle.yml`` next to the inventory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
import shutil
import stat
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml

from controlplane._files import write_atomic
from controlplane.bundle.create import image_file
from controlplane.bundle.manifest import Manifest, verify_bundle
from controlplane.errors import BundleError, ConfigError
from controlplane.fleet.inventory import GPU_NODES_GROUP, key_path, read_inventory_vars
from controlplane.spec import Node
from controlplane.weights import cache_digest, read_manifest
from controlplane.weights.distribute import Peer, PeerCopy, distribute

if TYPE_CHECKING:
    from fabric import Connection

__all__ = ["GROUP_VARS_FILE", "LoadRequest", "LoadResult", "load_bundle", "mirror_vars"]

Progress = Callable[[str], None]
GROUP_VARS_FILE = PurePosixPath("group_vars/all/sarv_bundle.yml")
_MIRROR_PARTS = ("debs", "wheels", "models", "dashboards", "terraform")
_HOST_KEYS = (
    "ansible_host",
    "ansible_user",
    "ansible_port",
    "ansible_ssh_private_key_file",
    "ansible_private_key_file",
    "sarv_private_address",
    "sarv_site_registry",
)
_UNIT = "sarv-bundle-mirror"


@dataclass
class LoadRequest:
    bundle: Path
    inventory: Path
    allowed_signers: Path
    work: Path
    """Where the verified bundle is unpacked on this machine (the wheelhouse the roles copy stays here)."""
    base: Path | None = None
    publish_dir: Path | None = None
    """Publish the mirror tree to this local path (served by the site) instead of a serving node."""
    mirror_url: str | None = None
    """The URL the nodes reach the mirror at (default: http://<serving node's private address>:<port>)."""
    serve_host: str | None = None
    serve_dir: PurePosixPath = field(default_factory=lambda: PurePosixPath("/srv/sarv-bundle"))
    serve_port: int = 8765
    remote_model_cache: PurePosixPath = field(default_factory=lambda: PurePosixPath("/var/lib/sarv/models"))


@dataclass
class LoadResult:
    manifest: Manifest
    mirror_url: str
    group_vars: Path
    images: dict[str, list[str]] = field(default_factory=dict)
    """Image reference → the nodes it was loaded on (or ``registry:<ref>`` when pushed)."""
    weights: dict[str, list[PeerCopy]] = field(default_factory=dict)
    terraform_config: Path | None = None
    """A Terraform CLI config installing the bundle's providers (``TF_CLI_CONFIG_FILE``), if it has some."""


@dataclass
class _Host:
    node: Node
    private_address: str
    registry: str | None


def _hosts(inventory: Path) -> list[_Host]:
    hosts = []
    for name, groups, raw in read_inventory_vars(inventory, _HOST_KEYS):
        node = Node(
            name=name,
            address=str(raw.get("ansible_host") or name),
            groups=groups,
            ssh_user=raw.get("ansible_user"),
            ssh_port=int(raw.get("ansible_port") or 22),
            ssh_key_file=key_path(
                raw.get("ansible_ssh_private_key_file") or raw.get("ansible_private_key_file")
            ),
        )
        private = str(raw.get("sarv_private_address") or node.address)
        registry = raw.get("sarv_site_registry")
        hosts.append(_Host(node, private, str(registry) if registry else None))
    if not hosts:
        raise ConfigError(f"inventory {inventory} lists no hosts")
    return hosts


def mirror_vars(manifest: Manifest, url: str, wheelhouse: Path, registry: str | None) -> dict[str, Any]:
    """The roles' own mirror variables, pointed at what the bundle published."""
    out: dict[str, Any] = {}
    if manifest.by_part("debs"):
        out |= {
            "common_apt_mirror": f"{url}/debs",
            "common_apt_security_mirror": "",
            "common_apt_components": ["main"],
        }
    if manifest.by_part("wheels"):
        out["sarv_controlplane_wheelhouse"] = str(wheelhouse)
    if manifest.by_part("models"):
        out["common_model_store_url"] = f"{url}/models"
    if registry:
        # dockerd's registry-mirrors are URLs: a bare HOST[:PORT] is reached over HTTPS.
        mirror = registry if "://" in registry else f"https://{registry}"
        out |= {"common_container_registry_mirror": registry, "docker_registry_mirrors": [mirror]}
    return out


def _terraform_config(work: Path) -> Path:
    """A Terraform CLI config that installs providers from the unpacked mirror only (no registry)."""
    path = work / "terraform.tfrc"
    mirror = json.dumps(str(work / "terraform"))  # an HCL string literal is a JSON one
    path.write_text(f"provider_installation {{\n  filesystem_mirror {{\n    path = {mirror}\n  }}\n}}\n")
    return path


_WORK_MARK = ".sarv-bundle-work"


def _fresh_work(work: Path) -> None:
    """Empty ``work`` for unpacking; a directory that holds anything but an earlier unpack is refused."""
    if work.exists():
        if not (work / _WORK_MARK).is_file() and any(work.iterdir()):
            raise ConfigError(
                f"--work {work} is not empty and was not written by `llmctl bundle load`",
                hint="give an empty or new directory",
            )
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / _WORK_MARK).write_text("unpacked by llmctl bundle load; emptied by the next load\n")


def load_bundle(req: LoadRequest, connect: Callable[[Node], Connection], say: Progress) -> LoadResult:
    hosts = _hosts(req.inventory)
    _fresh_work(req.work)
    say(f"verify: {req.bundle}")
    manifest = verify_bundle(
        req.bundle, req.allowed_signers, base=req.base, extract_to=req.work, progress=say
    )
    tfrc = _terraform_config(req.work) if manifest.by_part("terraform") else None
    conns: dict[str, Connection] = {}

    def conn(host: _Host) -> Connection:
        if host.node.name not in conns:
            conns[host.node.name] = connect(host.node)
        return conns[host.node.name]

    try:
        url = _publish_mirror(req, hosts, conn, say)
        if manifest.by_part("debs"):
            key = req.work / "debs" / "sarv-bundle.asc"
            for host in hosts:
                say(f"debs: trusting the bundle's repository key on {host.node.name}")
                conn(host).put(str(key), "/etc/apt/trusted.gpg.d/sarv-bundle.asc")
        gpu_hosts = [h for h in hosts if GPU_NODES_GROUP in h.node.groups]
        images = _load_images(req, manifest, gpu_hosts, conn, say)
        weights = _spread_weights(req, manifest, gpu_hosts, conn, say)
    finally:
        for c in conns.values():
            c.close()
    registry = next((h.registry for h in hosts if h.registry), None)
    gv = _write_group_vars(req.inventory, mirror_vars(manifest, url, req.work / "wheels", registry))
    say(f"group_vars: wrote {gv}")
    return LoadResult(manifest, url, gv, images, weights, tfrc)


def _publish_mirror(
    req: LoadRequest, hosts: list[_Host], conn: Callable[[_Host], Connection], say: Progress
) -> str:
    tree = [req.work / p for p in _MIRROR_PARTS if (req.work / p).is_dir()]
    if req.publish_dir is not None:
        for part in tree:
            target = req.publish_dir / part.name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(part, target)
        say(f"mirror: published to {req.publish_dir}")
        if req.mirror_url is None:
            raise ConfigError(
                "--publish-dir needs --mirror-url: the URL the nodes reach that directory at",
                hint="e.g. --mirror-url http://mirror.internal/sarv (a web server you run serves the path)",
            )
        return req.mirror_url.rstrip("/")
    host = _serving_host(hosts, req.serve_host)
    c = conn(host)
    root = req.serve_dir
    _copy_mirror(c, host.node.name, req.work, tree, root, say=say)
    unit = (
        "[Unit]\nDescription=Sarv bundle mirror (apt repository, wheelhouse, model store)\n"
        "After=network.target\n\n[Service]\nUser=nobody\n"
        f"ExecStart=/usr/bin/python3 -m http.server --bind {host.private_address} "
        f"--directory {root} {req.serve_port}\nRestart=always\n\n[Install]\nWantedBy=multi-user.target\n"
    )
    c.run(f"printf %s {shlex.quote(unit)} > /etc/systemd/system/{_UNIT}.service", hide=True)
    c.run(
        f"systemctl daemon-reload && systemctl enable --now {_UNIT} && systemctl restart {_UNIT}", hide=True
    )
    url = f"http://{host.private_address}:{req.serve_port}"
    say(f"mirror: {host.node.name} serves {root} at {url}")
    return url


def _mirror_member(path: Path, arcname: str) -> tarfile.TarInfo:
    """The archive entry of ``path``: a regular file or a directory under a relative name, owned by root,
    no set-id bits; anything else (a symlink, a device, a FIFO) is refused rather than carried."""
    st = path.lstat()
    info = tarfile.TarInfo(arcname)
    if stat.S_ISDIR(st.st_mode):
        info.type, info.mode = tarfile.DIRTYPE, 0o755
    elif stat.S_ISREG(st.st_mode):
        info.type, info.size = tarfile.REGTYPE, st.st_size
        info.mode = 0o755 if st.st_mode & 0o111 else 0o644  # a provider binary stays executable
    else:
        raise BundleError(
            f"mirror: {path} is neither a regular file nor a directory; the mirror carries only those",
            hint=f"remove it from {path.parent}, or load the bundle again into a fresh --work directory",
        )
    info.mtime = int(st.st_mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _pack_mirror(work: Path, entries: list[Path], archive: Path) -> None:
    """Write ``entries`` (under ``work``) to one uncompressed tar, named relative to ``work``: the files
    are already compressed (.deb, .whl, weights), so compressing again costs time and saves nothing."""
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in entries:
            info = _mirror_member(path, path.relative_to(work).as_posix())
            if info.isreg():
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)


def _copy_mirror(
    c: Connection, name: str, work: Path, tree: list[Path], root: PurePosixPath, *, say: Progress
) -> None:
    """Copy the mirror parts to ``root`` on the host as one archive, unpacked into a sibling ``.incoming``
    directory that replaces ``root`` only once complete: a failure leaves the previous mirror served and
    the partial copy removed (or, with the connection gone, left where the next load empties it)."""
    incoming = root.with_name(f".{root.name}.incoming")
    remote_tar = root.with_name(f".{root.name}.incoming.tar")
    qr, qi, qa = (shlex.quote(str(p)) for p in (root, incoming, remote_tar))
    with tempfile.TemporaryDirectory(prefix=".mirror-", dir=work) as tmp:
        # In ``work`` (not /tmp, often a small tmpfs): the archive is as large as the mirror, and ``work``
        # has just taken the same bytes. The parts are its subdirectories, so the archive is not in them.
        archive = Path(tmp) / "mirror.tar"
        entries = [p for part in tree for p in [part, *sorted(part.rglob("*"))]]
        files = [p for p in entries if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        say(f"mirror: packing {len(files)} files ({size / 2**20:.1f} MiB)")
        _pack_mirror(work, entries, archive)
        c.run(f"rm -rf {qi} {qa} && mkdir -p {qi}", hide=True)
        try:
            say(f"mirror: copying to {name} ({archive.stat().st_size / 2**20:.1f} MiB)")
            c.put(str(archive), str(remote_tar))
            say(f"mirror: unpacking on {name}")
            res = c.run(
                f"tar -x --no-same-owner -f {qa} -C {qi}; rc=$?; rm -f {qa}; exit $rc", hide=True, warn=True
            )
            if res.return_code != 0:
                raise BundleError(
                    f"host {name}: unpacking the mirror failed: {res.stderr.strip()[-200:]}",
                    hint=f"check the free space under {root.parent} on {name}; the previous mirror is kept",
                )
            c.run(f"chmod -R a+rX {qi} && rm -rf {qr} && mv -T {qi} {qr}", hide=True)
        except BaseException:
            with contextlib.suppress(Exception):  # the connection may be what failed
                c.run(f"rm -rf {qi} {qa}", hide=True, warn=True)
            raise


def _serving_host(hosts: list[_Host], name: str | None) -> _Host:
    if name is not None:
        for host in hosts:
            if host.node.name == name:
                return host
        raise ConfigError(f"--serve-host {name} is not a host of the inventory")
    for group in ("controlplane", "service_nodes"):
        for host in hosts:
            if group in host.node.groups:
                return host
    raise ConfigError(
        "no host to serve the mirror from: the inventory has no controlplane or service_nodes group",
        hint="pass --serve-host NAME, or --publish-dir PATH --mirror-url URL",
    )


def _load_images(
    req: LoadRequest,
    manifest: Manifest,
    hosts: list[_Host],
    conn: Callable[[_Host], Connection],
    say: Progress,
) -> dict[str, list[str]]:
    refs = [r for r in manifest.parts.get("images", {}) if r != "left_out"]
    done: dict[str, list[str]] = {}
    for ref in refs:
        tar = req.work / "images" / image_file(ref)
        registry = next((h.registry for h in hosts if h.registry), None)
        if registry:
            say(f"images: pushing {ref} to {registry}")
            target = _registry_ref(registry, ref)
            for argv in (
                ["docker", "load", "-i", str(tar)],
                ["docker", "tag", ref, target],
                ["docker", "push", target],
            ):
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
                if proc.returncode != 0:
                    raise BundleError(f"cannot push {ref} to {registry}: {proc.stderr.strip()[-200:]}")
            done[ref] = [f"registry:{target}"]
            continue
        done[ref] = []
        for host in hosts:
            say(f"images: docker load {ref} on {host.node.name}")
            c = conn(host)
            # Under /var/tmp (disk, not a tmpfs): an engine image is many GiB.
            remote = f"/var/tmp/sarv-image-{hashlib.sha256(ref.encode()).hexdigest()[:12]}.tar"  # noqa: S108
            c.put(str(tar), remote)
            res = c.run(f"docker load -i {remote}; rc=$?; rm -f {remote}; exit $rc", hide=True, warn=True)
            if res.return_code != 0:
                raise BundleError(
                    f"host {host.node.name}: docker load of {ref} failed: {res.stderr.strip()[-200:]}"
                )
            done[ref].append(host.node.name)
    return done


def _registry_ref(registry: str, ref: str) -> str:
    """``ref`` under the site registry: ``nvcr.io/nvidia/x:1`` → ``REGISTRY/nvidia/x:1``."""
    first, _, rest = ref.partition("/")
    path = rest if rest and ("." in first or ":" in first or first == "localhost") else ref
    return f"{registry.split('://', 1)[-1].rstrip('/')}/{path}"


def _spread_weights(
    req: LoadRequest,
    manifest: Manifest,
    hosts: list[_Host],
    conn: Callable[[_Host], Connection],
    say: Progress,
) -> dict[str, list[PeerCopy]]:
    out: dict[str, list[PeerCopy]] = {}
    if not hosts:
        return out
    for store_path in manifest.parts.get("models", {}):
        local = req.work / "models" / store_path
        digest = cache_digest(read_manifest(local))
        model = PurePosixPath(store_path).parts[0]
        dest = req.remote_model_cache / model / digest
        peers = [Peer(h.node.name, conn(h), h.private_address, 22, h.node.ssh_user or "root") for h in hosts]
        say(f"weights: {store_path} → {dest} on {len(peers)} nodes")
        out[store_path] = distribute(local, dest, peers, progress=say)
    return out


def _write_group_vars(inventory: Path, values: dict[str, Any]) -> Path:
    base = inventory if inventory.is_dir() else inventory.parent
    path = base / GROUP_VARS_FILE
    text = (
        "---\n# Written by `llmctl bundle load`: the roles' mirror variables, pointed at the loaded bundle.\n"
    )
    text += yaml.safe_dump(values, sort_keys=True)
    try:
        write_atomic(path, text, mode=0o644)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc}") from None
    return path
