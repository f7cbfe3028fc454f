"""Keeps one local replica's engine running: restarts it after a crash, stops it on SIGTERM.

Run by :class:`~controlplane.launchers.local.LocalLauncher` as the replica's session leader::

    python -m controlplane.launchers.supervisor --restarts 3 --status STATUS.json -- ENGINE ARGV...

The engine inherits the supervisor's output (the replica log), environment and process group, so
stopping the group stops both. ``STATUS.json`` holds ``{"restarts": N, "last_exit_code": C}`` for the
launcher to read: a restart while a deploy awaits readiness means the engine crashed during start-up.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

__all__ = ["main"]

_STABLE_S = 60.0
"""An engine that ran this long before crashing starts over with the shortest back-off."""


def _write_status(path: Path, restarts: int, code: int | None) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"restarts": restarts, "last_exit_code": code}))
    tmp.replace(path)  # atomic: the launcher never reads half a file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane.launchers.supervisor")
    parser.add_argument("--restarts", type=int, default=3, help="restarts allowed after crashes")
    parser.add_argument("--status", type=Path, required=True, help="JSON file with the restart count")
    parser.add_argument("--backoff-max", type=float, default=30.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no engine command after --")

    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    restarts, delay = 0, 1.0
    _write_status(args.status, 0, None)
    while True:
        started = time.monotonic()
        try:
            child = subprocess.Popen(command)
        except OSError as exc:
            print(f"=== sarv: cannot start {command[0]}: {exc.strerror}", flush=True)
            return 127
        code = child.wait()
        if stopping or code == 0 or restarts >= args.restarts:
            _write_status(args.status, restarts, code)
            return code if code >= 0 else 128 - code
        restarts += 1
        if time.monotonic() - started > _STABLE_S:
            delay = 1.0
        _write_status(args.status, restarts, code)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        what = f"restart {restarts}/{args.restarts} in {delay:.0f}s"
        print(f"=== sarv: {stamp} engine exited with code {code}; {what}", flush=True)
        deadline = time.monotonic() + delay
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.1)
        if stopping:
            return 0
        delay = min(args.backoff_max, delay * 2)


if __name__ == "__main__":
    sys.exit(main())
