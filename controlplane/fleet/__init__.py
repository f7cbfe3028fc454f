"""The fleet: nodes, GPUs and their topology, from an Ansible inventory, a fleet file, or discovery."""

from controlplane.fleet.discovery import discover_fleet, discover_node, local_fleet, probe_gpus
from controlplane.fleet.inventory import declared_gpus, read_ansible_inventory, read_fleet_file
from controlplane.fleet.loader import load_fleet
from controlplane.fleet.nvidia_smi import gpus_from_nvidia_smi, parse_gpu_query, parse_topology

__all__ = [
    "declared_gpus",
    "discover_fleet",
    "discover_node",
    "gpus_from_nvidia_smi",
    "load_fleet",
    "local_fleet",
    "parse_gpu_query",
    "parse_topology",
    "probe_gpus",
    "read_ansible_inventory",
    "read_fleet_file",
]
