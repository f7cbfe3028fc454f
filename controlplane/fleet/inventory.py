"""Read the fleet from a fleet file (JSON/YAML ``Fleet``) or an Ansible inventory via ansible-core."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from controlplane.errors import InventoryError, describe_validation_error
from controlplane.spec import GPU, Fleet, Interconnect, Node

__all__ = [
    "GPU_NODES_GROUP",
    "declared_gpus",
    "is_fleet_document",
    "key_path",
    "load_document",
    "read_ansible_inventory",
    "read_fleet_file",
    "read_inventory_vars",
]

GPU_NODES_GROUP = "gpu_nodes"
"""Hosts of this group (directly or through child groups) are fleet nodes even without GPU variables."""

_YAML_SUFFIXES = {".yml", ".yaml", ".json"}
# Inventory variables Sarv reads.
_HOST_VARS = (
    "sarv_gpu_model",
    "sarv_gpu_count",
    "sarv_gpu_memory_mib",
    "sarv_gpu_compute_capability",
    "sarv_gpu_interconnect",
    "sarv_gpus_per_pcie_switch",
    "sarv_numa_nodes",
    "sarv_nic",
    "sarv_labels",
    "sarv_gpus",
    "ansible_host",
    "ansible_user",
    "ansible_port",
    "ansible_ssh_private_key_file",
    "ansible_private_key_file",
)
_DECLARING_VARS = ("sarv_gpu_model", "sarv_gpu_count", "sarv_gpu_memory_mib", "sarv_gpus")
_ALLOWED = {
    "sarv_gpu_model": "a product name as nvidia-smi prints it, e.g. A100-SXM4-80GB",
    "sarv_gpu_count": "a whole number from 0 to 64",
    "sarv_gpu_memory_mib": "a whole number of MiB above 0, e.g. 81920",
    "sarv_gpu_compute_capability": "a CUDA compute capability MAJOR.MINOR, e.g. 8.6",
    "sarv_gpu_interconnect": "nvlink or pcie",
    "sarv_gpus_per_pcie_switch": "a whole number from 1 to 64",
    "sarv_numa_nodes": "a whole number from 1 to 64",
    "sarv_nic": "an interface name, e.g. ib0",
    "sarv_labels": "comma-separated key=value pairs, or a mapping",
    "sarv_gpus": "a list of mappings with model, memory_total_mib and optional index, uuid, "
    "nvlink_peers, pcie_switch, numa_node",
    "ansible_host": "a host name or IP address",
    "ansible_user": "a user name",
    "ansible_port": "a port from 1 to 65535",
    "ansible_ssh_private_key_file": "the path of a private key file",
    "ansible_private_key_file": "the path of a private key file",
}


class _HostVars(BaseModel):
    """The Sarv-relevant variables of one inventory host, typed (INI ``:vars`` values arrive as strings)."""

    model_config = ConfigDict(extra="ignore", str_strip_whitespace=True)

    sarv_gpu_model: str | None = Field(default=None, min_length=1)
    sarv_gpu_count: int | None = Field(default=None, ge=0, le=64)
    sarv_gpu_memory_mib: int | None = Field(default=None, gt=0)
    sarv_gpu_compute_capability: str | None = Field(default=None, pattern=r"^\d{1,2}\.\d$")
    sarv_gpu_interconnect: Interconnect | None = None
    sarv_gpus_per_pcie_switch: int | None = Field(default=None, ge=1, le=64)
    sarv_numa_nodes: int = Field(default=1, ge=1, le=64)
    sarv_nic: str | None = Field(default=None, min_length=1)
    sarv_labels: dict[str, str] = Field(default_factory=dict)
    sarv_gpus: list[dict[str, Any]] | None = None
    ansible_host: str | None = Field(default=None, min_length=1)
    ansible_user: str | None = Field(default=None, min_length=1)
    ansible_port: int | None = Field(default=None, ge=1, le=65535)
    ansible_ssh_private_key_file: str | None = Field(default=None, min_length=1)
    ansible_private_key_file: str | None = Field(default=None, min_length=1)

    @field_validator("sarv_gpu_interconnect", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("sarv_gpu_compute_capability", mode="before")
    @classmethod
    def _capability(cls, v: object) -> object:
        # On a host line Ansible reads 8.9 as a float (and 9 as an int); a capability is MAJOR.MINOR text.
        if isinstance(v, int | float) and not isinstance(v, bool):
            return f"{float(v):.1f}"
        return v

    @field_validator("sarv_labels", mode="before")
    @classmethod
    def _labels(cls, v: object) -> object:
        if v is None or v == "":
            return {}
        if isinstance(v, str):
            labels: dict[str, str] = {}
            for pair in v.split(","):
                key, sep, value = pair.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"label {pair.strip()!r} is not key=value")
                labels[key.strip()] = value.strip()
            return labels
        if isinstance(v, Mapping):
            return {str(k): str(x) for k, x in v.items()}
        return v


def _plain(value: Any) -> Any:
    """Plain Python values from ansible-core's tagged subclasses (str/int/dict/list with data tags)."""
    # bool before int: bool is an int subclass.
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def is_fleet_document(data: object) -> bool:
    """A fleet file has top-level ``nodes`` as a list (or ``version``); a YAML inventory has groups."""
    return isinstance(data, Mapping) and (isinstance(data.get("nodes"), list) or "version" in data)


def read_fleet_file(path: Path, data: object) -> Fleet:
    """Validate an already-parsed fleet document."""
    try:
        return Fleet.model_validate(data)
    except ValidationError as exc:
        raise InventoryError(
            f"{path}: {describe_validation_error(exc, what='fleet file')}",
            hint="see docs/fleet.md for the format, or regenerate it with `llmctl inventory --output yaml`",
        ) from None


def declared_gpus(
    *,
    model: str,
    count: int,
    memory_mib: int,
    interconnect: Interconnect,
    per_switch: int | None,
    numa_nodes: int,
    compute_capability: str | None = None,
) -> list[GPU]:
    """GPUs of a node as the inventory declares them, with topology derived from the declared shape.

    NVLink: every GPU is a peer of every other. PCIe: consecutive GPUs share a switch in groups of
    ``per_switch`` (default 2); with NVLink, switches are only recorded when ``per_switch`` is given.
    NUMA: GPUs are split across ``numa_nodes`` in index order (8 GPUs, 2 nodes → 0,0,0,0,1,1,1,1).
    """
    if per_switch is None and interconnect is Interconnect.PCIE:
        per_switch = 2
    gpus = []
    for i in range(count):
        gpus.append(
            GPU(
                index=i,
                model=model,
                memory_total_mib=memory_mib,
                nvlink_peers=[p for p in range(count) if p != i]
                if interconnect is Interconnect.NVLINK
                else [],
                pcie_switch=f"pcie{i // per_switch}" if per_switch else None,
                numa_node=i * numa_nodes // count,
                compute_capability=compute_capability,
            )
        )
    return gpus


def _bad_var(host: str, exc: ValidationError) -> InventoryError:
    err = exc.errors(include_url=False)[0]
    var = str(err["loc"][0]) if err.get("loc") else "?"
    value = err.get("input")
    allowed = _ALLOWED.get(var, "see inventory.example.ini")
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return InventoryError(
        f"host {host}: {var}={value!r} is invalid ({msg}); allowed: {allowed}",
        hint="fix it in the inventory: host line, group :vars or group_vars/",
    )


def _node_from_vars(name: str, groups: list[str], raw: Mapping[str, Any]) -> Node | None:
    # Membership first: a service host's variables are not Sarv's to judge. Only variables that
    # declare GPUs make a node: a default such as sarv_gpu_interconnect in all:vars must not pull
    # every Redis and Prometheus host into the fleet.
    if GPU_NODES_GROUP not in groups and not any(k in raw for k in _DECLARING_VARS):
        return None
    try:
        hv = _HostVars.model_validate(raw)
    except ValidationError as exc:
        raise _bad_var(name, exc) from None
    interconnect = hv.sarv_gpu_interconnect or Interconnect.PCIE

    gpus: list[GPU] = []
    model, memory = hv.sarv_gpu_model, hv.sarv_gpu_memory_mib
    if hv.sarv_gpus is not None:
        gpus = _irregular_gpus(name, hv.sarv_gpus, interconnect, hv.sarv_numa_nodes)
    elif hv.sarv_gpu_count:
        if model is None or memory is None:
            missing = [
                var for var, v in (("sarv_gpu_model", model), ("sarv_gpu_memory_mib", memory)) if v is None
            ]
            raise InventoryError(
                f"host {name}: sarv_gpu_count={hv.sarv_gpu_count} needs {' and '.join(missing)}",
                hint="declare them next to it, or drop the count and use `llmctl inventory --discover`",
            )
        gpus = declared_gpus(
            model=model,
            count=hv.sarv_gpu_count,
            memory_mib=memory,
            interconnect=interconnect,
            per_switch=hv.sarv_gpus_per_pcie_switch,
            numa_nodes=hv.sarv_numa_nodes,
            compute_capability=hv.sarv_gpu_compute_capability,
        )
    try:
        return Node(
            name=name,
            address=hv.ansible_host or name,
            groups=groups,
            labels=hv.sarv_labels,
            gpus=gpus,
            interconnect=interconnect,
            nic=hv.sarv_nic,
            ssh_user=hv.ansible_user,
            ssh_port=hv.ansible_port or 22,
            ssh_key_file=key_path(hv.ansible_ssh_private_key_file or hv.ansible_private_key_file),
        )
    except ValidationError as exc:
        raise InventoryError(f"host {name}: {describe_validation_error(exc, what='node')}") from None


def key_path(value: str | None) -> str | None:
    """A host's private key as Ansible reads it: ``~`` expanded, relative to the working directory."""
    return str(Path(value).expanduser().absolute()) if value else None


def _irregular_gpus(
    name: str, items: list[dict[str, Any]], interconnect: Interconnect, numa_nodes: int
) -> list[GPU]:
    """``sarv_gpus``: one mapping per GPU, for hosts whose GPUs differ; unset topology is derived."""
    gpus: list[GPU] = []
    for position, item in enumerate(items):
        spec = {"index": position, **item}
        try:
            gpus.append(GPU.model_validate(spec))
        except ValidationError as exc:
            raise InventoryError(
                f"host {name}: sarv_gpus[{position}] is invalid: "
                f"{describe_validation_error(exc, what='GPU').removeprefix('invalid GPU: ')}; "
                f"allowed: {_ALLOWED['sarv_gpus']}"
            ) from None
    indices = [g.index for g in gpus]
    if interconnect is Interconnect.NVLINK and not any(g.nvlink_peers for g in gpus):
        gpus = [g.model_copy(update={"nvlink_peers": [i for i in indices if i != g.index]}) for g in gpus]
    if all(g.numa_node is None for g in gpus) and gpus:
        order = sorted(indices)
        gpus = [
            g.model_copy(update={"numa_node": order.index(g.index) * numa_nodes // len(order)}) for g in gpus
        ]
    return gpus


def _ansible_error_line(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return str(text).strip().splitlines()[0] if str(text).strip() else type(exc).__name__


def _check_parses(path: Path, loader: Any) -> None:
    """Run ansible-core's own ini/yaml plugin on the file first, to turn a parse failure into one line.

    InventoryManager only prints such failures as warnings and carries on with an empty inventory.
    """
    from ansible.errors import AnsibleError
    from ansible.inventory.data import InventoryData
    from ansible.plugins.loader import inventory_loader

    # Ansible's own order for a file: the yaml plugin takes .yml/.yaml/.json (and no suffix), ini the rest.
    names = ["yaml"] if path.suffix in _YAML_SUFFIXES else ["ini"] if path.suffix else ["yaml", "ini"]
    errors: list[str] = []
    for name in names:
        plugin = inventory_loader.get(name)
        if plugin is None:
            continue
        try:
            plugin.parse(InventoryData(), loader, str(path), cache=False)
        except AnsibleError as exc:
            errors.append(f"as {name}: {_ansible_error_line(exc)}")
            continue
        return
    raise InventoryError(
        f"cannot read {path} as an Ansible inventory ({'; '.join(errors) or 'no inventory plugin'})",
        hint=f"check it with `ansible-inventory -i {path} --graph`",
    )


def _resolved_hosts(path: Path, keys: Sequence[str]) -> Iterator[tuple[str, list[str], dict[str, Any]]]:
    """Each host of an Ansible inventory (file or directory) with its groups and the templated values of
    ``keys``, resolved by ansible-core itself (InventoryManager + VariableManager, incl. group_vars/)."""
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    # Ansible wants absolute sources (its CLI resolves them the same way).
    path = path.resolve()
    loader = DataLoader()
    if path.is_file():
        _check_parses(path, loader)
    try:
        inventory = InventoryManager(loader=loader, sources=[str(path)])
        variables = VariableManager(loader=loader, inventory=inventory)
    except AnsibleError as exc:
        raise InventoryError(f"cannot read inventory {path}: {_ansible_error_line(exc)}") from None

    for host in inventory.get_hosts():
        hostvars = variables.get_vars(host=host, include_hostvars=False)
        templar = Templar(loader=loader, variables=hostvars)
        raw: dict[str, Any] = {}
        for key in keys:
            if key not in hostvars:
                continue
            try:
                raw[key] = _plain(templar.template(hostvars[key]))
            except AnsibleError as exc:
                raise InventoryError(
                    f"host {host.name}: cannot template {key}: {_ansible_error_line(exc)}",
                    hint="define the variables it refers to, or give a literal value",
                ) from None
        groups = sorted(g.name for g in host.get_groups() if g.name not in {"all", "ungrouped"})
        yield host.name, groups, raw


def read_ansible_inventory(path: Path) -> Fleet:
    """Fleet nodes of an Ansible inventory (file or directory), with groups, children and vars resolved
    by ansible-core itself (InventoryManager + VariableManager, incl. group_vars/ and host_vars/)."""
    nodes: list[Node] = []
    for name, groups, raw in _resolved_hosts(path, _HOST_VARS):
        node = _node_from_vars(name, groups, raw)
        if node is not None:
            nodes.append(node)
    try:
        return Fleet(nodes=nodes)
    except ValidationError as exc:
        raise InventoryError(f"{path}: {describe_validation_error(exc, what='fleet')}") from None


def read_inventory_vars(path: Path, keys: Sequence[str]) -> list[tuple[str, list[str], dict[str, Any]]]:
    """Every host of the inventory (service hosts too) with its groups and the values of ``keys``."""
    return list(_resolved_hosts(path, keys))


def load_document(path: Path) -> object | None:
    """The parsed JSON/YAML document at ``path``, or None when it is not JSON/YAML (e.g. INI)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read {path}: {exc}") from None
    try:
        document: object = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError):
        # Not a fleet document; Ansible's own parser reports what is wrong with it, in its words.
        return None
    return document
