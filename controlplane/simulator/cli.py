"""Command line of the simulator: one ``--option`` per :class:`SimConfig` field, named as vLLM names them."""

from __future__ import annotations

import argparse
import enum
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from controlplane.errors import ConfigError, describe_validation_error
from controlplane.simulator.config import SimConfig

__all__ = ["build_parser", "config_args", "main", "parse_config"]


# vLLM options with no meaning for a simulator (hardware, weights, parallelism).
_IGNORED_VALUE_OPTIONS = (
    "--kv-cache-dtype",
    "--max-num-batched-tokens",
    "--max-loras",
    "--max-lora-rank",
    "--download-dir",
    "--load-format",
    "--swap-space",
    "--distributed-executor-backend",
)
_IGNORED_FLAGS = ("--trust-remote-code", "--enforce-eager", "--enable-lora", "--disable-log-requests")


def _scalar_type(annotation: Any) -> Any:
    """The non-None member of ``X | None``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return members[0]
    return annotation


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m controlplane.simulator",
        description="A vLLM-compatible simulated engine: OpenAI API, /health and vLLM's /metrics.",
    )
    for name, info in SimConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = _scalar_type(info.annotation)
        doc = (info.description or "").strip()
        default = "" if info.default_factory is not None else f" (default: {info.default})"
        help_text = f"{doc}{default}" if doc else default.strip(" ()") or None
        if kind is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag, dest=name, nargs="*", default=None, metavar="NAME", help=help_text)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            choices = [m.value for m in kind]
            parser.add_argument(flag, dest=name, choices=choices, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=None, help=help_text)
    ignored = parser.add_argument_group(
        "vLLM options accepted and ignored", "so that a vLLM command line can start the simulator unchanged"
    )
    for flag in _IGNORED_VALUE_OPTIONS:
        ignored.add_argument(flag, dest=None, metavar="X", help=argparse.SUPPRESS)
    for flag in _IGNORED_FLAGS:
        ignored.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return parser


def parse_config(argv: Sequence[str]) -> SimConfig:
    """A validated :class:`SimConfig` from command-line arguments; :class:`ConfigError` when invalid."""
    args = build_parser().parse_args(list(argv))
    values = {k: v for k, v in vars(args).items() if v is not None and k in SimConfig.model_fields}
    if "api_key" not in values and os.environ.get("VLLM_API_KEY"):
        values["api_key"] = os.environ["VLLM_API_KEY"]
    try:
        return SimConfig.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, what="simulator options")) from None


def config_args(config: SimConfig) -> list[str]:
    """The command-line options that reproduce ``config`` (fields left at their defaults are omitted).

    ``api_key`` is never put on the command line, where any user could read it in the process list:
    pass it as ``VLLM_API_KEY`` in the environment.
    """
    out: list[str] = []
    defaults = SimConfig()
    for name in SimConfig.model_fields:
        value = getattr(config, name)
        if name == "api_key" or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            out += [flag, *value]
        elif isinstance(value, enum.Enum):
            out += [flag, str(value.value)]
        else:
            out += [flag, str(value)]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        sys.stderr.write(f"error: {err}\n")
        return err.exit_code
    if config.exit_at_start is not None:
        sys.stderr.write(f"ERROR sim: exit_at_start: exiting with status {config.exit_at_start}\n")
        return config.exit_at_start
    from controlplane.simulator.gpu import GpuCheckError, check_gpu_stand_in

    try:
        check_gpu_stand_in(config, os.environ)
    except GpuCheckError as err:
        # vLLM's way: the exception on stderr, then a non-zero exit before the server listens.
        sys.stderr.write(f"ERROR sim: {type(err.cause).__name__}: {err.cause}\n")
        return 1

    import uvicorn

    from controlplane.simulator.app import create_app

    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        # Hung requests (hang_rate) hold their connection; do not let them hold up a shutdown.
        timeout_graceful_shutdown=2,
        backlog=4096,
    )
    return 0
