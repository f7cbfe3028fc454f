"""Hardened systemd units for replicas and their Ray processes on remote nodes (pure text rendering)."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, field_validator

from controlplane.errors import LaunchError

__all__ = ["UNIT_DIR", "UnitSpec", "env_file_path", "render_unit", "systemd_quote", "unit_name"]

UNIT_DIR = PurePosixPath("/etc/systemd/system")
_ENV_DIR = PurePosixPath("/etc/sarv/replicas")
_UNIT_RE = re.compile(r"^sarv-[a-z0-9][a-z0-9.-]*\.service$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def unit_name(replica_id: str, role: str = "") -> str:
    """``sarv-<replica>.service`` for the engine, ``sarv-<replica>-<role>.service`` for its helpers."""
    name = f"sarv-{replica_id}{'-' + role if role else ''}.service"
    if not _UNIT_RE.fullmatch(name):
        raise LaunchError(f"replica id {replica_id!r} cannot name a systemd unit (use a-z, 0-9, '-', '.')")
    return name


def env_file_path(unit: str) -> PurePosixPath:
    """Where the unit's secret environment lives on the node: root-owned, 0600, read by systemd as root."""
    return _ENV_DIR / (unit.removesuffix(".service") + ".env")


def systemd_quote(arg: str) -> str:
    """One argv element for ``ExecStart=``: double-quoted, with ``%`` and ``$`` kept literal.

    systemd expands ``%x`` specifiers and ``$VAR`` in ExecStart even inside quotes; doubling them is
    its documented escape, so a value from a deploy option can never smuggle in a specifier.
    """
    if "\n" in arg or "\r" in arg or "\0" in arg:
        raise LaunchError(f"argument {arg[:40]!r} contains a line break and cannot go into a systemd unit")
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{escaped}"'


class UnitSpec(BaseModel):
    """What one unit runs and how it is confined."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = Field(min_length=1)
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    """Non-secret environment, written into the unit as ``Environment=``."""
    env_file: PurePosixPath | None = None
    """Secret environment (0600, root-owned); systemd reads it before dropping privileges."""
    user: str | None = None
    """A dedicated static user; None means ``DynamicUser=yes`` (a transient uid named ``sarv``)."""
    exec_stop: list[str] | None = None
    """A stop command (``ray stop``, ``docker stop``); None lets systemd signal the process tree."""
    exec_stop_post: list[str] | None = None
    protect_home: str = "yes"
    """``yes``, or ``read-only`` when the interpreter lives under /root or /home and must stay reachable."""
    bind_read_only: list[str] = Field(default_factory=list)
    """Host paths made visible read-only inside the unit's private /tmp (``BindReadOnlyPaths=``)."""
    joins_namespace_of: str | None = None
    """Share this unit's /tmp with another (the engine reaches its Ray head's sockets there)."""
    after: list[str] = Field(default_factory=list)
    restart: str = "on-failure"
    timeout_stop_s: int = Field(default=30, ge=1, le=3600)
    memory_max: str | None = None
    tasks_max: int = Field(default=4096, ge=16)

    @field_validator("name")
    @classmethod
    def _unit(cls, v: str) -> str:
        if not _UNIT_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a sarv-*.service unit name")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_KEY_RE.fullmatch(key) or "\n" in value:
                raise ValueError(f"environment entry {key!r} cannot go into a systemd unit")
        return v

    @field_validator("protect_home")
    @classmethod
    def _home(cls, v: str) -> str:
        if v not in {"yes", "read-only", "tmpfs"}:
            raise ValueError("protect_home must be yes, read-only or tmpfs")
        return v

    @property
    def state_dir(self) -> str:
        """``StateDirectory=`` below /var/lib: the unit's only writable place (and its HOME)."""
        return "sarv/" + self.name.removesuffix(".service")


def _exec(argv: list[str]) -> str:
    return " ".join(systemd_quote(a) for a in argv)


def render_unit(spec: UnitSpec) -> str:
    """The unit file text. Hardening follows systemd.exec(5); each relaxation carries its reason."""
    unit = [
        "# Managed by Sarv (llmctl); edits are overwritten on the next deploy.",
        "[Unit]",
        f"Description={spec.description}",
        "After=network-online.target" + "".join(f" {a}" for a in spec.after),
        "Wants=network-online.target",
    ]
    if spec.after:
        unit.append("Requires=" + " ".join(spec.after))
    if spec.joins_namespace_of:
        unit.append(f"JoinsNamespaceOf={spec.joins_namespace_of}")
    # Engine start-up (weights, warm-up) can take minutes; a crash loop stops after 5 tries in 10 min.
    unit += ["StartLimitIntervalSec=600", "StartLimitBurst=5", "", "[Service]", "Type=exec"]
    if spec.user is None:
        unit += ["DynamicUser=yes", "User=sarv"]
    else:
        unit.append(f"User={spec.user}")
    unit += [
        f"StateDirectory={spec.state_dir}",
        "StateDirectoryMode=0700",
        f"WorkingDirectory=/var/lib/{spec.state_dir}",
        f"Environment=HOME=/var/lib/{spec.state_dir}",
    ]
    unit += [f"Environment={systemd_quote(f'{k}={v}')}" for k, v in sorted(spec.env.items())]
    if spec.env_file is not None:
        unit.append(f"EnvironmentFile={spec.env_file}")
    unit.append(f"ExecStart={_exec(spec.argv)}")
    if spec.exec_stop:
        unit.append(f"ExecStop={_exec(spec.exec_stop)}")
    if spec.exec_stop_post:
        unit.append(f"ExecStopPost=-{_exec(spec.exec_stop_post)}")
    unit += [
        f"Restart={spec.restart}",
        "RestartSec=5",
        f"TimeoutStopSec={spec.timeout_stop_s}",
        "KillMode=control-group",
        f"TasksMax={spec.tasks_max}",
    ]
    if spec.memory_max:
        unit.append(f"MemoryMax={spec.memory_max}")
    unit += [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        f"ProtectHome={spec.protect_home}",
        *(f"BindReadOnlyPaths={systemd_quote(p)}" for p in spec.bind_read_only),
        "PrivateTmp=yes",
        "PrivateDevices=no",  # GPU engines need /dev/nvidia*; CPU engines gain nothing from hiding them
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        "RestrictNamespaces=yes",
        "LockPersonality=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "UMask=0077",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(unit)
