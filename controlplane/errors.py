"""Sarv's exception hierarchy; every error a user can cause is a :class:`SarvError`.

::

    SarvError                      exit 1, one-line message, never a traceback in the CLI
    ├── UserError                  exit 2: the input is wrong; the message says what and how to fix it
    │   ├── ConfigError            settings, config file or environment
    │   ├── InventoryError         inventory / fleet file unreadable or inconsistent
    │   ├── UnknownModelError      model name not in the catalog
    │   └── NotFoundError          deployment, replica or key does not exist
    ├── PlacementError             exit 3: the request is valid but does not fit the fleet
    ├── DiscoveryError             exit 4: a host could not be reached or its GPU probe was unreadable
    ├── StateError                 exit 5: the state store (SQLite / Redis) failed
    ├── LaunchError                exit 6: a replica failed to start; the deploy was rolled back
    │   └── WeightsError           weights missing or failing their sha256 manifest
    ├── ProvisionError             exit 7: Terraform / Ansible wrappers failed
    └── BundleError                exit 8: an offline bundle is incomplete, tampered with or unsigned
"""

from __future__ import annotations

__all__ = [
    "BundleError",
    "ConfigError",
    "DiscoveryError",
    "InventoryError",
    "LaunchError",
    "NotFoundError",
    "PlacementError",
    "ProvisionError",
    "SarvError",
    "StateError",
    "UnknownModelError",
    "UserError",
    "WeightsError",
    "describe_validation_error",
]


class SarvError(Exception):
    """Base class: ``str(err)`` is a complete one-line message for the user."""

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message} ({hint})")


class UserError(SarvError):
    exit_code = 2


class ConfigError(UserError):
    pass


class InventoryError(UserError):
    pass


class UnknownModelError(UserError):
    pass


class NotFoundError(UserError):
    pass


class PlacementError(SarvError):
    exit_code = 3


class DiscoveryError(SarvError):
    exit_code = 4


class StateError(SarvError):
    exit_code = 5


class LaunchError(SarvError):
    exit_code = 6


class WeightsError(LaunchError):
    pass


class ProvisionError(SarvError):
    exit_code = 7


def describe_validation_error(exc: object, *, what: str = "input") -> str:
    """One line naming each invalid field and what it accepts, from a pydantic ``ValidationError``."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return f"invalid {what}: {exc}"
    parts: list[str] = []
    for err in errors(include_url=False):
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__") or what
        msg = str(err.get("msg", "invalid value"))
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return f"invalid {what}: " + "; ".join(parts)


class BundleError(SarvError):
    exit_code = 8
