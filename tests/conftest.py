"""Fixture plugins shared by every test area (see tests/fixtures/), two guards (a SIGTERM ends the run as
Ctrl-C does, and standard input stays blocking from one test to the next), and the CPU time in the summary:
the whole process's and the tests that took most."""

import os
import resource
import signal
import threading
from collections.abc import Generator, Iterator
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


_CPU_BY_TEST: dict[str, float] = {}
_CPU_TOP = 15


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds of this process, and of the children it has reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Each test's CPU time, setup to teardown: this process's and that of the children reaped meanwhile."""
    start = sum(_cpu_seconds())
    try:
        return (yield)
    finally:
        _CPU_BY_TEST[item.nodeid] = sum(_cpu_seconds()) - start


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The CPU time this pytest process used, itself and the children it waited for (Ansible, QEMU, engines,
    SSH); the processes of containers are Docker's and not counted. scripts/test's whole run prints one such
    line for each of its pytest processes, to show which one the two cores went to, and the tests that took
    most of it (``--durations`` ranks by wall time, which on shared cores mostly measures waiting). A child
    counts for the test during which it was reaped: a server a module's fixture started, for the module's
    last test."""
    own, children = _cpu_seconds()
    terminalreporter.write_line(
        f"CPU: {own:.0f} s in this process, {children:.0f} s in its children (containers not counted)"
    )
    if len(_CPU_BY_TEST) > 1:
        top = sorted(_CPU_BY_TEST.items(), key=lambda kv: kv[1], reverse=True)[:_CPU_TOP]
        terminalreporter.write_line(f"CPU of the {len(top)} tests that took most (setup to teardown):")
        for nodeid, seconds in top:
            terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
