"""`llmctl` commands: fleet (inventory)."""

from __future__ import annotations

from collections import Counter
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli import ui
from controlplane.cli.options import optional_path
from controlplane.spec import Fleet, Interconnect, Node

__all__ = ["OutputFormat", "register", "topology_summary"]


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"
    YAML = "yaml"


def _gib(mib: float) -> str:
    if 0 < mib < 1024:
        return f"{mib:g} MiB"
    return f"{mib / 1024:.1f}".removesuffix(".0") + " GiB"


def _gpus_cell(node: Node) -> str:
    if not node.gpus:
        return "-"
    counts = Counter(g.model for g in node.gpus)
    return ", ".join(f"{n} × {model}" for model, n in counts.items())


def _memory_cell(node: Node) -> str:
    if not node.gpus:
        return "-"
    sizes = sorted({g.memory_total_mib for g in node.gpus}, reverse=True)
    text = "/".join(_gib(s) for s in sizes) + " each"
    used = sum(g.memory_used_mib for g in node.gpus)
    # Only discovery knows what is in use; a declared inventory always says 0.
    return f"{text}, {_gib(used)} used" if used else text


def topology_summary(node: Node) -> str:
    """One line about how the GPUs of ``node`` connect: NVLink, PCIe switch groups, NUMA nodes."""
    if not node.gpus:
        return "-"
    parts: list[str] = []
    indices = {g.index for g in node.gpus}
    links = sum(len(g.nvlink_peers) for g in node.gpus) // 2
    if len(node.gpus) > 1 and all(set(g.nvlink_peers) == indices - {g.index} for g in node.gpus):
        parts.append("NVLink all-to-all")
    elif links:
        parts.append(f"NVLink {links} link{'s' if links != 1 else ''}")
    switches = Counter(g.pcie_switch for g in node.gpus if g.pcie_switch is not None)
    if switches and node.interconnect is Interconnect.PCIE:
        sizes = sorted(switches.values(), reverse=True)
        parts.append(
            f"{len(switches)} PCIe switch{'es' if len(switches) != 1 else ''} ({'+'.join(map(str, sizes))})"
        )
    numa = {g.numa_node for g in node.gpus if g.numa_node is not None}
    if numa:
        parts.append(f"{len(numa)} NUMA node{'s' if len(numa) != 1 else ''}")
    return "; ".join(parts) or "-"


def _labels_cell(node: Node) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(node.labels.items())) or "-"


def _print_table(fleet: Fleet) -> None:
    rows = [
        [
            n.name,
            n.address if n.ssh_port == 22 else f"{n.address}:{n.ssh_port}",
            _gpus_cell(n),
            _memory_cell(n),
            n.interconnect.value if n.gpus else "-",
            topology_summary(n),
            _labels_cell(n),
        ]
        for n in fleet.nodes
    ]
    ui.table(["NODE", "ADDRESS", "GPUS", "MEMORY", "INTERCONNECT", "TOPOLOGY", "LABELS"], rows)
    gpus = [g for n in fleet.nodes for g in n.gpus]
    total = sum(g.memory_total_mib for g in gpus)
    ui.out(
        f"{len(fleet.nodes)} node{'s' if len(fleet.nodes) != 1 else ''}, {len(gpus)} GPUs, "
        f"{_gib(total)} GPU memory"
    )


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""

    @app.command("inventory")
    def inventory(
        *,
        inventory: Annotated[
            Path | None,
            typer.Option(
                "-i",
                "--inventory",
                parser=optional_path,
                metavar="PATH",
                help="Ansible inventory (INI/YAML) or fleet file (JSON/YAML). "
                "Default: $SARV_INVENTORY, else this host.",
            ),
        ] = None,
        discover: Annotated[
            bool,
            typer.Option(
                "--discover",
                help="Replace declared GPUs with what nvidia-smi reports on each node (over SSH).",
            ),
        ] = False,
        output: Annotated[
            OutputFormat, typer.Option("--output", "-o", help="table, or the fleet file as json or yaml.")
        ] = OutputFormat.TABLE,
        ssh_key: Annotated[
            Path | None,
            typer.Option(
                "--ssh-key",
                help="Private key for --discover (default: the ssh_key_file setting, $SARV_SSH_KEY_FILE, "
                "as deploy uses; else ssh-agent and ~/.ssh/id_*).",
            ),
        ] = None,
        known_hosts: Annotated[
            Path | None,
            typer.Option(
                "--known-hosts",
                help="Refuse hosts whose key is not in this file (default: accept on first sight).",
            ),
        ] = None,
        connect_timeout: Annotated[
            float,
            typer.Option(
                "--connect-timeout", min=0.5, max=300.0, help="Seconds to wait for each SSH connection."
            ),
        ] = 10.0,
    ) -> None:
        """Show the fleet: nodes, GPUs, interconnect, topology and labels."""
        from controlplane.fleet import discover_fleet, load_fleet
        from controlplane.remote import FabricConnector
        from controlplane.settings import load_settings

        settings = load_settings()
        source = inventory if inventory is not None else settings.inventory
        fleet = load_fleet(source)
        if discover and source is not None:
            # The key deploy and the launchers use, unless one is given: discovery reaches the same nodes.
            key = ssh_key if ssh_key is not None else settings.ssh_key_file
            connector = FabricConnector(key_filename=key, known_hosts=known_hosts)
            fleet = discover_fleet(fleet, connector=connector, connect_timeout=connect_timeout)
        if source is not None and not fleet.nodes:
            ui.warn(
                f"no fleet nodes in {source}: put GPU hosts in group gpu_nodes or give them sarv_gpu_* vars"
            )
        if output is OutputFormat.JSON:
            ui.print_json(fleet.model_dump(mode="json"))
        elif output is OutputFormat.YAML:
            ui.print_yaml(fleet.model_dump(mode="json"))
        else:
            _print_table(fleet)
