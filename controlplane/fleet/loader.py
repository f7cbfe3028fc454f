"""``load_fleet``: the one entry point other modules use to get the fleet from a path, or from this host."""

from __future__ import annotations

from pathlib import Path

from controlplane.errors import InventoryError
from controlplane.fleet.discovery import local_fleet
from controlplane.fleet.inventory import (
    is_fleet_document,
    load_document,
    read_ansible_inventory,
    read_fleet_file,
)
from controlplane.spec import Fleet

__all__ = ["load_fleet"]


def load_fleet(source: Path | str | None) -> Fleet:
    """The fleet described by ``source``.

    - None or "": this host alone (named after it, address 127.0.0.1, GPUs from a local ``nvidia-smi``);
    - a fleet file (JSON/YAML with top-level ``version``/``nodes``, as ``llmctl inventory -o json`` writes);
    - an Ansible inventory file or directory (INI or YAML), read with ansible-core's own loader.
    """
    if source is None or source == "":  # Path("") would be the current directory
        return local_fleet()
    path = Path(source).expanduser()
    if not path.exists():
        raise InventoryError(
            f"inventory {path} does not exist",
            hint="pass -i with an Ansible inventory or fleet file, or unset SARV_INVENTORY to use this host",
        )
    if path.is_file():
        document = load_document(path)
        if is_fleet_document(document):
            return read_fleet_file(path, document)
    return read_ansible_inventory(path)
