"""A typed wrapper over the ``terraform`` CLI's ``-json`` event stream, used by ``llmctl infra``.

Why not python-terraform: its last release (0.10.1, 2019) predates Terraform 1.x. Its ``destroy()`` sends
``-force`` (removed in 0.15), it has no type hints, and it returns whole stdout strings, so progress could
only be shown after a command ends. ``terraform -json`` is a documented, versioned interface ("ui": "1.2"):
one JSON object per line (``version``, ``log``, ``diagnostic``, ``planned_change``, ``apply_start``,
``apply_complete``, ``change_summary`` …). A small wrapper over it gives typed events as they happen and
lets errors become one-line :class:`~controlplane.errors.ProvisionError` messages.

Secrets stay out of argv: variables come only from ``-var-file`` paths, and cloud credentials from the
environment or ``clouds.yaml``, which Terraform's providers read themselves. State and plan files are
created under umask 077 and tightened to 0600 after every run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane._files import write_atomic
from controlplane.errors import ProvisionError

__all__ = [
    "ChangeSummary",
    "Diagnostic",
    "RunResult",
    "Terraform",
    "TerraformEvent",
    "write_inventory",
]

_PLAN_FILE = ".sarv.tfplan"
_STATE_GLOBS = ("*.tfstate", "*.tfstate.backup", "terraform.tfstate.d/**/*.tfstate*", _PLAN_FILE)

_HINTS = {
    "init": "check the module sources; offline sites need a provider mirror in the Terraform CLI config",
    "plan": "fix the variable or configuration named above and rerun `llmctl infra plan`",
    "apply": "the state keeps what was created; fix the cause and rerun `llmctl infra apply` to continue",
    "destroy": "the state keeps what is left; fix the cause and rerun `llmctl infra destroy`",
    "output": "run `llmctl infra apply` first",
}


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ChangeSummary(_Event):
    """Counts of a plan or an apply (the ``change_summary`` event)."""

    add: int = 0
    change: int = 0
    remove: int = 0
    import_: int = Field(default=0, alias="import")
    operation: str = "plan"


class Diagnostic(_Event):
    """An error or warning as Terraform reports it."""

    severity: str
    summary: str
    detail: str = ""
    address: str | None = None
    filename: str | None = None
    line: int | None = None

    def one_line(self) -> str:
        """Summary, first line of the detail and where, as one line."""
        parts = [self.summary.rstrip(".")]
        detail = next((ln.strip() for ln in self.detail.splitlines() if ln.strip()), "")
        if detail:
            parts.append(detail.rstrip("."))
        where = self.address or (f"{self.filename}:{self.line}" if self.filename else None)
        text = ": ".join(parts)
        return f"{text} ({where})" if where else text


class TerraformEvent(_Event):
    """One line of ``terraform … -json``, reduced to what a progress display needs."""

    type: str
    level: str = Field(default="info", alias="@level")
    message: str = Field(default="", alias="@message")
    address: str | None = None
    """Resource address for ``planned_change``/``apply_*``/``refresh_*`` events."""
    action: str | None = None
    diagnostic: Diagnostic | None = None
    changes: ChangeSummary | None = None


class RunResult(BaseModel):
    """What one terraform command did."""

    command: str
    events: list[TerraformEvent] = Field(default_factory=list)
    summary: ChangeSummary | None = None
    warnings: list[str] = Field(default_factory=list)


def _parse_event(line: str) -> TerraformEvent | None:
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict) or "type" not in raw:
        return None
    # Resource address and action sit under "hook" (apply/refresh) or "change" (plan) depending on type.
    inner = raw.get("hook") or raw.get("change") or {}
    resource = inner.get("resource") if isinstance(inner, dict) else None
    if isinstance(resource, dict):
        raw["address"] = resource.get("addr")
        raw["action"] = inner.get("action")
    diag = raw.get("diagnostic")
    if isinstance(diag, dict):
        rng = diag.get("range") or {}
        diag["filename"] = rng.get("filename")
        diag["line"] = (rng.get("start") or {}).get("line")
    try:
        return TerraformEvent.model_validate(raw)
    except ValidationError:
        return None


def _tighten(workdir: Path) -> None:
    """State and plan files hold every resource attribute (and may hold secrets): owner-only."""
    for pattern in _STATE_GLOBS:
        for path in workdir.glob(pattern):
            if path.is_file() and path.stat().st_mode & 0o077:
                path.chmod(0o600)


class Terraform:
    """Runs terraform in one root configuration directory (``-chdir``), streaming typed events.

    ``on_event`` is called for every event as it arrives (the CLI's progress display).
    """

    def __init__(
        self,
        workdir: Path,
        *,
        binary: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 3600.0,
        on_event: Callable[[TerraformEvent], None] | None = None,
    ) -> None:
        self.workdir = workdir.resolve()
        self._binary = binary
        self._env = env
        self._timeout_s = timeout_s
        self._on_event = on_event

    # --- public commands

    def init(self) -> RunResult:
        """``terraform init``: installs modules (and providers, from the CLI config's sources)."""
        return self._run("init", ["init", "-input=false", "-json"])

    def plan(self, var_files: Sequence[Path] = (), *, destroy: bool = False, save: bool = False) -> RunResult:
        """``terraform plan``; with ``save`` the plan is kept for :meth:`apply` in an owner-only file."""
        args = ["plan", "-input=false", "-json", *self._var_args(var_files)]
        if destroy:
            args.append("-destroy")
        if save:
            args.append(f"-out={_PLAN_FILE}")
        return self._run("plan", args)

    def apply(self, var_files: Sequence[Path] = (), *, use_saved_plan: bool = False) -> RunResult:
        """``terraform apply`` of the plan saved by :meth:`plan` (then deleted), or of a fresh one."""
        plan_file = self.workdir / _PLAN_FILE
        if use_saved_plan:
            if not plan_file.is_file():
                raise ProvisionError(
                    f"no saved plan in {self.workdir}",
                    hint="run the plan step first (llmctl infra apply does)",
                )
            args = ["apply", "-input=false", "-json", _PLAN_FILE]
        else:
            args = ["apply", "-input=false", "-json", "-auto-approve", *self._var_args(var_files)]
        try:
            return self._run("apply", args)
        finally:
            plan_file.unlink(missing_ok=True)

    def destroy(self, var_files: Sequence[Path] = ()) -> RunResult:
        """``terraform destroy -auto-approve`` (the caller asks the user first)."""
        return self._run(
            "destroy", ["destroy", "-input=false", "-json", "-auto-approve", *self._var_args(var_files)]
        )

    def outputs(self) -> dict[str, Any]:
        """Root module outputs as ``{name: value}`` (``terraform output -json``)."""
        proc = self._exec(["output", "-json"])
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no error text"])[-1]
            raise ProvisionError(f"terraform output failed in {self.workdir}: {last}", hint=_HINTS["output"])
        try:
            raw = json.loads(proc.stdout or "{}")
        except ValueError:
            raise ProvisionError(
                f"terraform output -json in {self.workdir} printed something that is not JSON",
                hint="check that the terraform binary is Terraform 1.x",
            ) from None
        return {name: spec.get("value") for name, spec in raw.items() if isinstance(spec, dict)}

    def inventory(self, output_name: str = "inventory") -> str:
        """The Ansible inventory text the configuration outputs as ``output_name``."""
        outputs = self.outputs()
        if not outputs:
            raise ProvisionError(f"{self.workdir} has no outputs yet", hint=_HINTS["output"])
        value = outputs.get(output_name)
        if not isinstance(value, str) or not value.strip():
            known = ", ".join(sorted(outputs)) or "none"
            raise ProvisionError(
                f"{self.workdir} has no string output {output_name!r} (outputs: {known})",
                hint='add `output "inventory" { value = module.<name>.inventory }` to the root configuration',
            )
        return value

    # --- internals

    def _var_args(self, var_files: Sequence[Path]) -> list[str]:
        args: list[str] = []
        for path in var_files:
            if not path.is_file():
                raise ProvisionError(
                    f"variables file {path} does not exist", hint="pass an existing --var-file"
                )
            args.append(f"-var-file={path.resolve()}")
        return args

    def _resolve_binary(self) -> str:
        found = shutil.which(self._binary or "terraform")
        if not found:
            raise ProvisionError(
                f"{self._binary or 'terraform'} was not found or is not executable",
                hint="install Terraform >= 1.9 (a single binary) or pass its path with --terraform",
            )
        return found

    def _check_workdir(self) -> None:
        if not self.workdir.is_dir():
            raise ProvisionError(
                f"{self.workdir} is not a directory", hint="pass --dir with a Terraform root"
            )
        if not any(self.workdir.glob("*.tf")):
            raise ProvisionError(
                f"{self.workdir} contains no *.tf files",
                hint="copy an example such as infra/modules/static/examples/basic and point --dir at it",
            )

    def _environ(self) -> dict[str, str]:
        env = dict(os.environ if self._env is None else self._env)
        # No prompts, no update check over the network, output meant for a wrapper.
        env.update({"TF_IN_AUTOMATION": "1", "TF_INPUT": "0", "CHECKPOINT_DISABLE": "1"})
        return env

    def _exec(self, args: list[str]) -> subprocess.CompletedProcess[str]:
        self._check_workdir()
        try:
            return subprocess.run(
                [self._resolve_binary(), f"-chdir={self.workdir}", *args],
                capture_output=True,
                text=True,
                env=self._environ(),
                timeout=self._timeout_s,
                umask=0o077,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ProvisionError(
                f"terraform {args[0]} did not finish within {self._timeout_s:.0f}s", hint=_HINTS[args[0]]
            ) from None

    def _run(self, command: str, args: list[str]) -> RunResult:
        self._check_workdir()
        binary = self._resolve_binary()
        result = RunResult(command=command)
        errors: list[Diagnostic] = []
        with (
            tempfile.TemporaryFile(mode="w+") as stderr,
            subprocess.Popen(
                [binary, f"-chdir={self.workdir}", *args],
                stdout=subprocess.PIPE,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                text=True,
                env=self._environ(),
                umask=0o077,
            ) as proc,
        ):
            # Iterating stdout blocks, so the time limit is enforced by a timer that kills the process.
            timer = threading.Timer(self._timeout_s, proc.kill)
            timer.start()
            try:
                for line in proc.stdout or ():
                    event = _parse_event(line)
                    if event is None:
                        continue
                    self._record(event, result, errors)
                returncode = proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                _tighten(self.workdir)
            stderr.seek(0)
            stderr_text = stderr.read()
        if returncode != 0:
            raise ProvisionError(
                self._failure(command, returncode, errors, stderr_text), hint=_HINTS[command]
            )
        return result

    def _record(self, event: TerraformEvent, result: RunResult, errors: list[Diagnostic]) -> None:
        result.events.append(event)
        if event.changes is not None:
            result.summary = event.changes
        if event.diagnostic is not None:
            if event.diagnostic.severity == "error":
                errors.append(event.diagnostic)
            else:
                result.warnings.append(event.diagnostic.one_line())
        if self._on_event is not None:
            self._on_event(event)

    def _failure(self, command: str, returncode: int, errors: list[Diagnostic], stderr_text: str) -> str:
        prefix = f"terraform {command} failed in {self.workdir}"
        if errors:
            more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
            return f"{prefix}: {errors[0].one_line()}{more}"
        if returncode < 0:
            return f"{prefix}: killed after {self._timeout_s:.0f}s"
        lines = [ln.strip(" │╷╵") for ln in stderr_text.splitlines()]
        lines = [ln for ln in lines if ln and "CLI configuration" not in ln and ".terraformrc" not in ln]
        return f"{prefix} with exit code {returncode}: {lines[-1] if lines else 'no error text'}"


def write_inventory(text: str, path: Path) -> Path:
    """Write the inventory atomically (temporary file in the same directory, then rename)."""
    path = path.expanduser()
    try:
        # Inventories carry host addresses, not secrets, yet need not be world-readable either.
        write_atomic(path, text if text.endswith("\n") else text + "\n", mode=0o640)
    except OSError as exc:
        raise ProvisionError(
            f"cannot write inventory {path}: {exc.strerror}", hint="choose a writable path"
        ) from None
    return path
