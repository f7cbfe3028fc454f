"""Settings shared by the CLI, the gateway and the controller: one YAML file plus ``SARV_*`` variables.

Precedence (highest first): explicit arguments, environment (``SARV_STATE_URL``, ``SARV_INVENTORY`` …),
the YAML config file (``$SARV_CONFIG``, else ``~/.config/sarv/config.yaml`` when present), the mirrors the
``common`` role records (``$SARV_MIRRORS_ENV``, else ``/etc/sarv/mirrors.env`` when present), defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, get_args

from pydantic import Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from controlplane.errors import ConfigError, describe_validation_error

__all__ = ["Settings", "default_config_path", "load_settings", "mirrors_env_path"]

_MIRRORS_ENV = Path("/etc/sarv/mirrors.env")


def _default_home() -> Path:
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "sarv"


def default_config_path() -> Path:
    env = os.environ.get("SARV_CONFIG")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config") / "sarv" / "config.yaml"


def mirrors_env_path() -> Path:
    """The ``SARV_*`` mirror file the ``common`` role writes on every host (roles/common, mirrors.env)."""
    env = os.environ.get("SARV_MIRRORS_ENV")
    return Path(env) if env else _MIRRORS_ENV


def _holds_path(annotation: Any) -> bool:
    """True for ``Path``, ``Path | None``, ``list[Path]`` and the like."""
    return annotation is Path or any(_holds_path(arg) for arg in get_args(annotation))


class _EnvSource(EnvSettingsSource):
    """``SARV_*`` variables, where an empty value of a path setting means unset.

    ``Path("")`` is the current directory: ``SARV_INVENTORY=`` would otherwise make ansible-core run every
    executable file there as an inventory script. Other settings keep their empty strings.
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        value, key, is_complex = super().get_field_value(field, field_name)
        if value == "" and _holds_path(field.annotation):
            return None, key, is_complex
        return value, key, is_complex


class _MirrorsSource(DotEnvSettingsSource):
    """The ``common`` role's ``mirrors.env``: the ``SARV_*`` keys Settings knows; others are the engines'."""

    def __call__(self) -> dict[str, Any]:
        known = set(self.settings_cls.model_fields)
        return {k: v for k, v in super().__call__().items() if k in known}


class Settings(BaseSettings):
    """Sarv's settings. Every field can be set as ``SARV_<FIELD>`` or as a key of the config file."""

    model_config = SettingsConfigDict(env_prefix="SARV_", extra="forbid", validate_default=True)

    home: Path = Field(default_factory=_default_home)
    """Local data: SQLite state, replica logs, model cache for the embedded default."""
    state_url: str = ""
    """``sqlite:///PATH`` (default: ``<home>/state.db``), ``redis://…``, ``rediss://…``,
    ``redis+cluster://host:port,…`` or ``rediss+cluster://…`` (docs/state.md)."""
    state_prefix: str = "sarv:"
    """Key prefix in Redis, so several Sarv installs can share one Redis."""
    redis_username: str | None = None
    redis_password: str | None = None
    redis_tls_ca: Path | None = None
    redis_tls_cert: Path | None = None
    redis_tls_key: Path | None = None
    inventory: Path | None = None
    """Ansible inventory (INI/YAML) or fleet file; unset means this host is the fleet."""
    catalog: list[Path] = Field(default_factory=list)
    """Extra model catalog files (YAML) or Hugging Face model directories."""
    model_cache: Path | None = None
    """Where weights land on a node (default: ``<home>/models``; the RAID-0 mount on GPU nodes)."""
    vllm_image: str | None = None
    """Container image of the ``vllm`` engine, overriding the GPU table's (e.g. a digest from the site's
    registry mirror, ``registry.local/vllm-openai@sha256:…``); unset: ``<vllm_image_repository>:<tag>``
    with the tag of the replica's GPU generation (gpu_generations.yaml)."""
    vllm_image_repository: str = "vllm/vllm-openai"
    """Repository of the table's image tags (a registry mirror's path on an offline site)."""
    ray_version: str | None = None
    """Ray version every node's venv must run for process engines (``sim``, ``vllm-cpu``) across nodes;
    None: any, as long as all nodes of a replica agree. Container engines run their image's own Ray."""
    ray_join_timeout_s: float = Field(default=180.0, gt=0)
    """How long a replica across nodes waits for its Ray cluster to form (the head up, then every member
    joined), each; raise it where nodes start Ray slowly (a cold image cache, busy CPUs)."""
    model_store_url: str = ""
    """The site's model store (``common_model_store_url``; a loaded bundle's ``<mirror>/models``): weights of
    a variant with no other source are fetched from ``<model_store_url>/<model>/<variant>``."""
    registry_mirror: str = ""
    """The site's container registry (``common_container_registry_mirror``): with no ``vllm_image``, the
    engine image is ``<registry host>/<vllm_image_repository>:<tag>``."""
    pypi_index_url: str = ""
    """The site's PyPI index (``common_pypi_index_url``), recorded for tools that install packages."""
    remote_python: str = "/opt/sarv/venv/bin/python"
    """Interpreter on remote nodes for process engines (``sim``, ``vllm-cpu``) and Ray: a venv with Sarv."""
    remote_model_cache: Path = Path("/var/lib/sarv/models")
    """Where verified weights land on remote nodes (the RAID-0 mount on GPU nodes)."""
    ssh_key_file: Path | None = None
    """Private key for SSH to remote nodes (default: the agent and ``~/.ssh/id_*``, as ssh does)."""
    ssh_known_hosts: Path | None = None
    """When set, unknown or changed host keys of remote nodes are refused."""
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(default=8080, ge=1, le=65535)
    gateway_tls_cert: Path | None = None
    """PEM certificate chain of the gateway's HTTPS listener (with ``gateway_tls_key``), reloaded on HUP."""
    gateway_tls_key: Path | None = None
    """Its unencrypted PEM private key (0600, readable by the gateway's user only)."""
    gateway_tls_client_ca: Path | None = None
    """When set, callers must present a client certificate this CA signed (service-to-service mTLS)."""
    gateway_metrics_host: str = "127.0.0.1"
    """Address of the gateway's metrics listener (``/metrics``): loopback, or the private interface."""
    gateway_metrics_port: int = Field(default=9107, ge=0, le=65535)
    """Its port; 0: no metrics listener."""
    gateway_metrics_token_file: Path | None = None
    """A file holding a bearer token that scrapers of ``/metrics`` must present (none: no token)."""
    ratelimit_fail_open: bool = True
    """When the rate limiter's Redis is unreachable: admit (True, the default) or refuse with 503."""
    ratelimit_lease_fraction: float = Field(default=0.002, ge=0.0, le=0.1)
    """Share of each limit a gateway books in Redis at once and admits from locally (0: one Redis call per
    request). A gateway holds back at most this much of a key's limit from the others, for at most 1 s."""

    @model_validator(mode="before")
    @classmethod
    def _empty_paths_are_unset(cls, data: Any) -> Any:
        """An empty path from the config file or an argument means unset, as it does in ``SARV_*``."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, field in cls.model_fields.items():
            if name not in out or not _holds_path(field.annotation):
                continue
            value = out[name]
            if value == "":
                del out[name]
            elif isinstance(value, list):
                out[name] = [item for item in value if item != ""]
        return out

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = default_config_path()
        sources: list[PydanticBaseSettingsSource] = [init_settings, _EnvSource(settings_cls)]
        if path.is_file():
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        mirrors = mirrors_env_path()
        if mirrors.is_file():
            sources.append(_MirrorsSource(settings_cls, env_file=mirrors))
        return tuple(sources)

    @property
    def resolved_state_url(self) -> str:
        return self.state_url or f"sqlite:///{self.home / 'state.db'}"

    @property
    def resolved_vllm_image_repository(self) -> str:
        """``vllm_image_repository``, below the site registry's host when ``registry_mirror`` is set."""
        if not self.registry_mirror:
            return self.vllm_image_repository
        host = self.registry_mirror.split("://", 1)[-1].strip("/")
        return f"{host}/{self.vllm_image_repository}"

    @property
    def resolved_model_cache(self) -> Path:
        return self.model_cache or self.home / "models"


def load_settings(**overrides: Any) -> Settings:
    """Settings from file and environment, with ``overrides`` (non-None values) on top."""
    path = default_config_path()
    if os.environ.get("SARV_CONFIG") and not path.is_file():
        raise ConfigError(f"config file {path} (from SARV_CONFIG) does not exist")
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, what="settings")) from None
    except (OSError, ValueError) as exc:  # unreadable or malformed YAML
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
