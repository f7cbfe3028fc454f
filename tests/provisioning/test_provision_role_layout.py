"""Every role follows one layout: phase files tagged ``<role>`` + ``<role>_<phase>``, the service step in
``tasks/run.yml``, and service starts and restarts skipped in check mode (HOUSE_STYLE Ansible #3, #5)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from fixtures.common import REPO

ROLES = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks" / "main.yml").is_file())
PHASES = ["preflight", "install", "configure", "run"]
_SERVICE_MODULES = {
    "ansible.builtin.systemd_service",
    "ansible.builtin.systemd",
    "ansible.builtin.service",
    "systemd_service",
    "systemd",
    "service",
}
_STARTS = {"started", "restarted", "reloaded"}


def _whens(task: dict[str, Any]) -> list[str]:
    when = task.get("when", [])
    return [str(w) for w in (when if isinstance(when, list) else [when])]


def _tasks(items: list[dict[str, Any]], inherited: list[str]) -> Iterator[tuple[dict[str, Any], list[str]]]:
    """Every task of a task list with the ``when`` conditions it carries, its blocks' included."""
    for item in items or []:
        whens = inherited + _whens(item)
        if "block" in item:
            for key in ("block", "rescue", "always"):
                yield from _tasks(item.get(key) or [], whens)
        else:
            yield item, whens


def _service_starts(role: str) -> Iterator[tuple[str, str, list[str]]]:
    """(file, task name, conditions) of each task or handler that starts, restarts or reloads a service."""
    files = sorted((REPO / "roles" / role / "tasks").glob("*.yml"))
    files += sorted((REPO / "roles" / role / "handlers").glob("*.yml"))
    for path in files:
        for task, whens in _tasks(yaml.safe_load(path.read_text()), []):
            for module in _SERVICE_MODULES & task.keys():
                state = str((task[module] or {}).get("state", ""))
                if any(s in state for s in _STARTS):  # also a templated state
                    yield str(path.relative_to(REPO)), task["name"], whens


@pytest.mark.parametrize("role", ROLES)
def test_service_step_is_run_yml_tagged_role_run(role: str) -> None:
    tasks = REPO / "roles" / role / "tasks"
    assert not (tasks / "service.yml").exists(), f"{role}: the service step is tasks/run.yml"
    if not list(_service_starts(role)):
        return
    assert (tasks / "run.yml").is_file(), f"{role} runs a service but has no tasks/run.yml"
    main = yaml.safe_load((tasks / "main.yml").read_text())
    imports = {t.get("ansible.builtin.import_tasks"): t for t in main}
    assert "run.yml" in imports, f"{role}: tasks/main.yml does not import run.yml"
    assert f"{role}_run" in imports["run.yml"]["tags"]


@pytest.mark.parametrize("role", [r for r in ROLES if r != "preflight"])
def test_phase_imports_carry_the_role_and_phase_tags(role: str) -> None:
    for task in yaml.safe_load((REPO / "roles" / role / "tasks" / "main.yml").read_text()):
        target = task.get("ansible.builtin.import_tasks")
        phase = str(target).removesuffix(".yml")
        if phase in PHASES:
            assert task["tags"] == [role, f"{role}_{phase}"], f"{role}: import of {target}"


@pytest.mark.parametrize("role", ROLES)
def test_service_starts_and_restarts_are_skipped_in_check_mode(role: str) -> None:
    unguarded = [
        f"{path}: {name}"
        for path, name, whens in _service_starts(role)
        if not any("not ansible_check_mode" in w for w in whens)
    ]
    assert unguarded == [], "add `when: not ansible_check_mode`"
