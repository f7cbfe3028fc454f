"""Declarative deployments (``llmctl apply -f FILE``): read a YAML file of deployments, compare each with
the desired state, and bring the store to it: create, scale, or roll a changed spec out as a canary
(:mod:`controlplane.controller.rollout`)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.controller.deploy import Deployer
from controlplane.errors import UserError, describe_validation_error
from controlplane.spec import IN_PLACE_FIELDS, DeploymentSpec

__all__ = ["Action", "Change", "load_manifest", "plan_changes"]

_AUTO = "auto"


class Action(StrEnum):
    CREATE = "create"
    SCALE = "scale"
    """Only the replica counts, bounds or scale-to-zero settings: changed in place."""
    UNCHANGED = "unchanged"
    ROLLOUT = "rollout"
    """A change of what the replicas run: started as a canary rollout."""
    REFUSED = "refused"
    """In-place settings and what the replicas run changed at once: one apply for each."""


class Change(BaseModel):
    """One deployment of the file against the desired state."""

    model_config = ConfigDict(extra="forbid")

    name: str
    action: Action
    spec: DeploymentSpec
    fields: dict[str, tuple[Any, Any]] = Field(default_factory=dict)
    """Changed fields: ``{field: (current, desired)}`` (empty for create and unchanged)."""

    def describe(self) -> str:
        """One line: ``~ web: replicas 1 -> 3``."""
        if self.action is Action.CREATE:
            spec = self.spec
            return f"+ {self.name}: create ({spec.model}, {spec.replicas} replica(s), tp={spec.tp})"
        if self.action is Action.UNCHANGED:
            return f"= {self.name}: unchanged"
        diffs = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in sorted(self.fields.items()))
        mark = {Action.SCALE: "~", Action.ROLLOUT: "»"}.get(self.action, "!")
        tail = {
            Action.SCALE: "",
            Action.ROLLOUT: " (a canary rollout)",
        }.get(self.action, " (replica counts and the rest at once: apply one, then the other)")
        return f"{mark} {self.name}: {diffs}{tail}"


def _show(value: Any) -> str:
    return "-" if value is None or value in ({}, []) else str(value)


def load_manifest(path: Path, deployer: Deployer) -> list[DeploymentSpec]:
    """The deployments in ``path`` (one mapping, a list of them, or several YAML documents), validated
    like ``llmctl deploy``'s options; errors name the file, the document (from 1) and the field."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{path} is not valid YAML{where}: {problem}") from None
    items: list[tuple[int, Any]] = []
    for number, doc in enumerate(documents, start=1):
        if isinstance(doc, list):
            items += [(number, d) for d in doc]
        else:
            items.append((number, doc))
    if not items:
        raise UserError(f"{path} holds no deployment", hint="give one mapping per deployment (name, model …)")
    specs: list[DeploymentSpec] = []
    for number, doc in items:
        specs.append(_spec(path, number, doc, deployer))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"{path}: deployment {dup[0]!r} is given twice")
    return specs


def _spec(path: Path, number: int, doc: Any, deployer: Deployer) -> DeploymentSpec:
    where = f"{path} document {number}"
    if not isinstance(doc, dict):
        raise UserError(f"{where}: a deployment must be a mapping of fields (name, model, replicas …)")
    data = dict(doc)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise UserError(f"{where}: model: field required (a catalog model name, see `llmctl models`)")
    canonical = deployer.catalog.get(model).name  # aliases deploy as the model they name
    data["model"] = canonical
    data.setdefault("name", canonical)
    if data.get("engine", _AUTO) == _AUTO:
        from controlplane.placement import choose_engine

        data["engine"] = choose_engine(deployer.fleet)[0].value
    try:
        spec = DeploymentSpec.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, what=where)) from None
    except UserError as exc:
        raise UserError(f"{where}: {exc.message}", hint=exc.hint) from None
    return spec


def plan_changes(deployer: Deployer, specs: list[DeploymentSpec]) -> list[Change]:
    """Each spec against the desired state in the store (nothing is changed)."""
    out: list[Change] = []
    for spec in specs:
        current = deployer.store.get_deployment(spec.name)
        if current is None:
            out.append(Change(name=spec.name, action=Action.CREATE, spec=spec))
            continue
        before, after = current.spec.model_dump(mode="json"), spec.model_dump(mode="json")
        fields = {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
        if not fields:
            action = Action.UNCHANGED
        elif set(fields) <= IN_PLACE_FIELDS:
            action = Action.SCALE
        elif not set(fields) & IN_PLACE_FIELDS:
            action = Action.ROLLOUT
        else:
            action = Action.REFUSED
        out.append(Change(name=spec.name, action=action, spec=spec, fields=fields))
    return out
