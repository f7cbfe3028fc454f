"""Fixture plugins shared by every test area (see tests/fixtures/), two guards (a SIGTERM ends the run as
Ctrl-C does, and standard input stays blocking from one test to the next), and a CPU line in the summary."""

import os
import resource
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import pytest

pytest_plugins = [
    "fixtures.redis",
    "fixtures.sim",
    "fixtures.testhosts",
    "fixtures.vllm",
    "fixtures.fleets",  # after fixtures.vllm, which it imports
]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a CI job cancelled, ``timeout``, ``kill``) ends the run as Ctrl-C does: pytest tears its
    fixtures down, so the session's test-host containers, Docker networks, VMs and servers are removed
    instead of outliving it, as they do when the process just dies."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The CPU time this pytest process used, itself and the children it waited for (Ansible, QEMU, engines,
    SSH); the processes of containers are Docker's and not counted. scripts/test's whole run prints one such
    line for each of its pytest processes, to show which one the two cores went to."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    terminalreporter.write_line(
        f"CPU: {own.ru_utime + own.ru_stime:.0f} s in this process, "
        f"{children.ru_utime + children.ru_stime:.0f} s in its children (containers not counted)"
    )
