"""The GPU smoke suite's `llmctl` command lines, parsed here by the real CLI (the suite runs on GPU hosts).

A smoke test that passes an option `llmctl` does not have could only fail on the GPU host, where it is
run least often; parsing its argv here catches that in the normal suite.
"""

from __future__ import annotations

from typing import Any

import pytest
import typer
from smoke.test_smoke_gpu_host import deploy_argv

from controlplane.cli.main import build_app


def parse(argv: list[str]) -> Any:
    """The subcommand's parsed context (typer >= 0.24 vendors click, so its classes are typer's own)."""
    group: Any = typer.main.get_command(build_app())
    parent = group.make_context("llmctl", argv[:1])
    name, command, rest = group.resolve_command(parent, list(argv))
    assert command is not None, name
    return command.make_context(str(name), rest, parent=parent)


def test_smoke_deploy_argv_is_accepted_by_llmctl() -> None:
    ctx = parse(deploy_argv("llama-3-8b", "smoke-x", "/srv/weights/llama-3-8b"))
    assert ctx.params["source"] == ["/srv/weights/llama-3-8b"]
    assert ctx.params["engine"].value == "vllm"


def test_an_option_llmctl_lacks_is_refused() -> None:
    with pytest.raises(typer.TyperException, match="No such option: --weights"):
        parse(["deploy", "llama-3-8b", "--weights", "/srv/weights"])
