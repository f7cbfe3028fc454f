"""What a site needs, read from where the project already says it: roles, the GPU table, the catalog."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from controlplane.catalog import Catalog
from controlplane.catalog.compat import load_compat
from controlplane.errors import ConfigError
from controlplane.spec import Fleet

__all__ = ["ROLE_PACKAGE_SOURCES", "engine_images", "model_weights", "role_images", "role_packages"]

_ROOT = Path(__file__).resolve().parents[2]

# Debian packages the roles install from the distribution's archive: (role file, key path). The NVIDIA
# roles install from NVIDIA's repositories (driver, CUDA, DCGM, container toolkit) and Grafana from its own:
# add those with --packages when this machine's apt sources include those repositories.
ROLE_PACKAGE_SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("roles/common/vars/Debian.yml", ("_common_packages",)),
    ("roles/docker/vars/main.yml", ("_docker_packages", "distro", "Debian")),
    ("roles/prometheus/defaults/main.yml", ("prometheus_package",)),
    ("roles/node_exporter/defaults/main.yml", ("node_exporter_package",)),
    ("roles/redis_cluster/defaults/main.yml", ("redis_cluster_package",)),
)
# Literal package lists inside tasks (nvme_raid: xfsprogs, mdadm for RAID-0; sarv_controlplane: the venv).
_TASK_PACKAGES = ("redis-tools", "xfsprogs", "mdadm", "python3", "python3-venv", "python3-packaging")


def _lookup(data: Any, keys: tuple[str, ...], where: str) -> list[str]:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            raise ConfigError(
                f"{where} has no {'.'.join(keys)} (the bundle's list of role packages is stale)"
            )
        data = data[key]
    return [data] if isinstance(data, str) else [str(x) for x in data]


def role_packages(root: Path = _ROOT) -> list[str]:
    """The Debian packages the roles install from the distribution's archive, read from the roles."""
    names: set[str] = set(_TASK_PACKAGES)
    for rel, keys in ROLE_PACKAGE_SOURCES:
        path = root / rel
        names.update(_lookup(yaml.safe_load(path.read_text()), keys, rel))
    return sorted(names)


_DCGM_KEYS = (
    "dcgm_exporter_image_registry",
    "dcgm_exporter_image_repository",
    "dcgm_exporter_image_tag",
    "dcgm_exporter_image_digest",
)


def role_images(inventory: Path, root: Path = _ROOT) -> tuple[list[str], list[str]]:
    """Images the roles run on the inventory's GPU nodes (dcgm-exporter, pinned by digest), and a note for
    each one that cannot be named because the inventory does not pin it."""
    from controlplane.fleet.inventory import GPU_NODES_GROUP, read_inventory_vars

    defaults = yaml.safe_load((root / "roles/dcgm_exporter/defaults/main.yml").read_text())
    refs: set[str] = set()
    notes: set[str] = set()
    for name, groups, raw in read_inventory_vars(inventory, _DCGM_KEYS):
        if GPU_NODES_GROUP not in groups:
            continue
        v = {k: str(raw.get(k, defaults.get(k, "")) or "") for k in _DCGM_KEYS}
        if not v["dcgm_exporter_image_digest"]:
            notes.add(f"dcgm-exporter: dcgm_exporter_image_digest is not set for {name}; pass --image REF")
            continue
        refs.add(
            f"{v['dcgm_exporter_image_registry']}/{v['dcgm_exporter_image_repository']}:"
            f"{v['dcgm_exporter_image_tag']}@{v['dcgm_exporter_image_digest']}"
        )
    return sorted(refs), sorted(notes)


def engine_images(fleet: Fleet, repository: str, override: str | None) -> list[str]:
    """The engine image of every GPU generation in the fleet (the compatibility table's tags)."""
    if override:
        return [override] if any(n.gpus for n in fleet.nodes) else []
    table = load_compat()
    refs = {
        table.image_for([table.generation_for(gpu)], repository) for node in fleet.nodes for gpu in node.gpus
    }
    return sorted(refs)


def model_weights(
    names: list[str], catalog: Catalog
) -> tuple[dict[str, str], dict[str, Callable[[Path], object]]]:
    """Model store paths (``MODEL/VARIANT``) → sources, and those generated here (the tiny test model)."""
    from controlplane.weights.tiny import TINY_MODEL_NAME, generate_tiny_model

    sources: dict[str, str] = {}
    generated: dict[str, Callable[[Path], object]] = {}
    for name in names:
        if name == TINY_MODEL_NAME:
            generated[f"{TINY_MODEL_NAME}/none"] = generate_tiny_model
            continue
        entry = catalog.entry(name)
        if not entry.sources:
            raise ConfigError(
                f"model {entry.name} has no weights sources in the catalog",
                hint=f"add sources.<variant> to its catalog entry, or pass --weights {entry.name}/none=DIR",
            )
        for variant, source in entry.sources.items():
            sources[f"{entry.name}/{variant.value}"] = source
    return sources, generated
