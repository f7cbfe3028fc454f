"""Fixture plugins shared by every test area (see tests/fixtures/), and one guard every test gets."""

import os
from collections.abc import Iterator

import pytest

pytest_plugins = [
    "fixtures.redis",
    "fixtures.sim",
    "fixtures.testhosts",
    "fixtures.vllm",
    "fixtures.fleets",  # after fixtures.vllm, which it imports
]


@pytest.fixture(autouse=True)
def _blocking_stdin() -> Iterator[None]:
    """Every child of this process shares its standard input (pytest's /dev/null). ssh and QEMU make theirs
    non-blocking and, killed at a timeout, leave it so; Ansible then refuses to start in every later test.
    The known callers give such children a /dev/null of their own; this puts the mode back after any other,
    so that one test's killed child cannot fail the ones after it."""
    yield
    try:
        if not os.get_blocking(0):
            os.set_blocking(0, True)
    except OSError:  # no standard input at all
        pass
