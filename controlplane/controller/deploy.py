"""One-shot deploy: plan → record desired → verify weights → launch → await ready → record observed."""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from controlplane.catalog import checkpoint_format
from controlplane.catalog.compat import CompatTable, Generation, load_compat
from controlplane.controller.events import record_event
from controlplane.controller.health import PROBED_STATES, HealthRule, judge, probe_path
from controlplane.engines.base import Engine, ReplicaContext, check_engine_args
from controlplane.errors import LaunchError, NotFoundError, PlacementError, SarvError, UserError, WeightsError
from controlplane.launchers import claim_handle
from controlplane.launchers.base import Launcher, ProcessState, ReplicaProcess, last_error_line
from controlplane.launchers.local import LocalLauncher
from controlplane.settings import Settings
from controlplane.spec import (
    IN_PLACE_FIELDS,
    DeploymentRecord,
    DeploymentSpec,
    EngineKind,
    Fleet,
    ModelSpec,
    Node,
    Plan,
    Quantization,
    ReplicaPlan,
    ReplicaRecord,
    ReplicaState,
    Shard,
    spec_version,
)
from controlplane.state.base import StateStore
from controlplane.weights import WeightsPolicy, read_source_json
from controlplane.weights.tiny import TINY_MODEL_NAME

__all__ = [
    "LAUNCH_MARK_S",
    "LEAVING_STATES",
    "DeployResult",
    "Deployer",
    "ModelCatalog",
    "Observation",
    "Planner",
    "check_sources",
    "default_engines",
]

Progress = Callable[[str, str], None]
"""``(key, description)``: one line of progress per key (a replica, the weights …)."""


LAUNCH_MARK_S = 1800.0
"""How long past its readiness timeout a launch keeps the controller off its deployment (weights of a
large model take that long to land); a deploy that crashed leaves a mark that runs out after this."""


class Planner(Protocol):
    """``(fleet, spec, model, shards already placed, avoid_nodes=…)``: ``placement.place`` with this host's
    answers. ``avoid_nodes`` are the nodes the deployment's other replicas run on (anti-affinity)."""

    def __call__(
        self,
        fleet: Fleet,
        spec: DeploymentSpec,
        model: ModelSpec,
        placed: list[Shard],
        /,
        *,
        avoid_nodes: Collection[str] = (),
    ) -> Plan: ...


LEAVING_STATES = frozenset({ReplicaState.DRAINING, ReplicaState.STOPPING})
"""Replicas on their way out: not counted as members, never restarted or judged by the health rule."""
LauncherFactory = Callable[[Node], Launcher]
GroupLauncherFactory = Callable[[list[Node]], Launcher]
"""Launcher for one replica whose pipeline stages span these nodes (pp rank order): Ray."""


class ModelCatalog(Protocol):
    def get(self, name: str) -> ModelSpec: ...


class DeployResult(BaseModel):
    """What ``deploy`` did: ``changed`` is False when the deployment already ran as asked."""

    model_config = ConfigDict(extra="forbid")

    deployment: str
    changed: bool
    replicas: list[ReplicaRecord] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def default_engines(settings: Settings) -> dict[EngineKind, Engine]:
    from controlplane.engines.sim import SimEngine
    from controlplane.engines.vllm import VllmEngine
    from controlplane.engines.vllm_cpu import VllmCpuEngine

    return {
        EngineKind.VLLM: VllmEngine(image=settings.vllm_image),
        EngineKind.VLLM_CPU: VllmCpuEngine(),
        EngineKind.SIM: SimEngine(),
    }


def _policy(spec: DeploymentSpec) -> WeightsPolicy:
    return WeightsPolicy(
        allow_pickle=spec.engine_args.get("allow_pickle_weights") is True,
        trust_remote_code=spec.engine_args.get("trust_remote_code") is True,
    )


def _http_check(url: str, api_key: SecretStr | None, timeout: float = 2.0) -> str | None:
    """None when ``url`` answers 200, else why not."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}
    try:
        code = httpx.get(url, headers=headers, timeout=timeout).status_code
    except httpx.HTTPError as exc:
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return None if code == 200 else f"HTTP {code}"


@dataclass(frozen=True)
class Observation:
    """One replica as :meth:`Deployer.observe` saw it: its record (after the health rule) and the probe."""

    record: ReplicaRecord
    probed: str | None = None
    """The path probed; None when nothing was (not running here, or in a state with nothing to probe)."""
    error: str | None = None
    """Why the probe failed; None when it passed (or nothing was probed)."""


@dataclass(frozen=True)
class _Prepared:
    """What the checks before any copy settled for one replica: its weights, vLLM method and image."""

    source: str | None
    quantization_method: str | None
    image: str | None


@dataclass
class _Launched:
    record: ReplicaRecord
    launcher: Launcher
    last_said: int = -1


@dataclass
class Deployer:
    """Applies deployments to the fleet once (``llmctl deploy``), and undoes them.

    Dependencies are injected: the store, fleet, catalog and planner are plain arguments, launchers
    come from a factory per node, and ``clock``/``sleep`` can be replaced in tests.
    """

    settings: Settings
    store: StateStore
    fleet: Fleet
    catalog: ModelCatalog
    planner: Planner
    launcher_factory: LauncherFactory
    engines: Mapping[EngineKind, Engine]
    progress: Progress | None = None
    python: str = "python3"
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    group_launcher_factory: GroupLauncherFactory | None = None
    """For replicas whose shards span several nodes; None refuses such plans with a clear error."""
    compat: CompatTable = field(default_factory=load_compat)
    """The GPU-generation table: which variants each replica's GPUs run, and the engine image."""
    marker: str = ""
    """What this deployer's launches record as ``DeploymentRecord.launching_by``: the controller sets its
    lease holder id; empty for ``llmctl``."""
    _launchers: dict[str, Launcher] = field(default_factory=dict)

    # --- helpers

    def _say(self, key: str, text: str) -> None:
        if self.progress is not None:
            self.progress(key, text)

    def _launcher(self, node_name: str) -> Launcher:
        if node_name not in self._launchers:
            try:
                node = self.fleet.node(node_name)
            except KeyError:
                raise LaunchError(
                    f"node {node_name} is not in the fleet", hint="check SARV_INVENTORY / --inventory"
                ) from None
            self._launchers[node_name] = self.launcher_factory(node)
        return self._launchers[node_name]

    def _replica_launcher(self, shards: list[Shard]) -> Launcher:
        """The node's launcher, or for pipeline stages on several nodes the group (Ray) launcher."""
        names = list(dict.fromkeys(s.node for s in sorted(shards, key=lambda s: s.pp_rank)))
        if len(names) <= 1:
            return self._launcher(names[0] if names else "")
        key = "group:" + ",".join(names)
        if key not in self._launchers:
            if self.group_launcher_factory is None:
                raise LaunchError(
                    f"the plan spans nodes {', '.join(names)}",
                    hint="multi-node pipeline parallelism needs the Ray launcher (remote nodes over SSH)",
                )
            missing = [n for n in names if n not in {node.name for node in self.fleet.nodes}]
            if missing:
                raise LaunchError(f"node {missing[0]} is not in the fleet", hint="check SARV_INVENTORY")
            self._launchers[key] = self.group_launcher_factory([self.fleet.node(n) for n in names])
        return self._launchers[key]

    def _launcher_for_record(self, rec: ReplicaRecord) -> Launcher | None:
        """The launcher that can act on ``rec``'s handle, or None when it runs elsewhere."""
        if rec.handle.get("launcher") == LocalLauncher.name:
            if rec.handle.get("host") not in {None, socket.gethostname()}:
                return None
            key = f"local:{rec.node}"
            if key not in self._launchers:
                try:
                    self._launchers[key] = self._launcher(rec.node)
                except LaunchError:
                    self._launchers[key] = LocalLauncher(
                        self.settings.home, self.settings.resolved_model_cache
                    )
            return self._launchers[key]
        if not rec.handle:
            return None
        try:
            return self._replica_launcher(rec.shards) if rec.shards else self._launcher(rec.node)
        except LaunchError:
            return None

    def _stoppable(self, rec: ReplicaRecord) -> tuple[Launcher, dict[str, str]] | None:
        """The launcher and handle that stop ``rec``'s process; None when no launcher here reaches it.

        A placed record without a handle was written before its launcher's start returned (see
        :meth:`_launch_all`): the start is in flight, or the deploy making it was killed and whatever it
        started runs on unrecorded. Its handle is then the one naming that by the replica's id
        (:func:`~controlplane.launchers.claim_handle`)."""
        if rec.handle:
            launcher = self._launcher_for_record(rec)
            return (launcher, rec.handle) if launcher is not None else None
        if not rec.shards:
            return None
        try:
            launcher = self._replica_launcher(rec.shards)
        except LaunchError:
            return None
        claim = claim_handle(launcher, rec.id)
        return (launcher, claim) if claim else None

    def _model_source(self, spec: DeploymentSpec, model: ModelSpec, variant: Quantization) -> str:
        """The weights of ``variant``: ``--source VARIANT=…``, then ``--source …``, then the catalog's, then
        the site's model store (``model_store_url``, e.g. a loaded bundle's)."""
        chosen = spec.sources.get(variant) or spec.source or model.sources.get(variant)
        if chosen:
            return chosen
        if self.settings.model_store_url:
            return f"{self.settings.model_store_url.rstrip('/')}/{model.name}/{variant.value}"
        if model.name == TINY_MODEL_NAME and variant is Quantization.NONE:
            # The tiny model is generated, never downloaded: deterministic, so every node gets the
            # same bytes (and the same manifest digest in the cache).
            from controlplane.weights.tiny import generate_tiny_model

            src = self.settings.resolved_model_cache / "_generated" / TINY_MODEL_NAME
            if not (src / "SHA256SUMS").is_file():
                self._say("weights", f"weights: generating {TINY_MODEL_NAME}")
                generate_tiny_model(src)
            return str(src)
        raise WeightsError(
            f"no weights source for the {variant.value} variant of {model.name}",
            hint=f"pass --source {variant.value}=DIR (or an http(s)/s3 URL with a SHA256SUMS manifest), "
            f"or add sources.{variant.value} to the model's catalog entry",
        )

    # --- checks before anything is copied or started

    def _preflight(
        self, spec: DeploymentSpec, model: ModelSpec, plan: Plan, todo: list[int]
    ) -> dict[int, _Prepared]:
        """Every refusal a deploy can meet before it copies a byte: tool calling without a parser, GPUs
        that cannot run the planned variant, a replica spanning generations with different images, a
        missing source or one whose config.json is another variant."""
        if spec.tools and model.tool_call_parser is None:
            raise UserError(
                f"{model.name} has no tool-call parser in the catalog, so tool calling cannot be turned on",
                hint="deploy without --tools, or give the model's catalog entry a tool_call_parser",
            )
        engine = self.engines.get(spec.engine)
        sources: dict[Quantization, tuple[str, str | None]] = {}
        out: dict[int, _Prepared] = {}
        for index in todo:
            rp = plan.replicas[index]
            rows = self._rows(rp, index)
            image = None
            if spec.engine is EngineKind.VLLM:
                image = self.settings.vllm_image or self.compat.image_for(
                    rows, self.settings.resolved_vllm_image_repository
                )
            self._check_layout(spec, rp, index, engine)
            source = method = None
            if engine is not None and self._lands_weights(spec, model, engine):
                if rp.quantization not in sources:
                    sources[rp.quantization] = self._checked_source(spec, model, rp.quantization)
                source, method = sources[rp.quantization]
            out[index] = _Prepared(source=source, quantization_method=method, image=image)
        return out

    def _lands_weights(self, spec: DeploymentSpec, model: ModelSpec, engine: Engine) -> bool:
        """Whether the replica gets verified weights on its nodes: engines that load them always; ``sim``
        when it has weights to rehearse with (a ``--source`` or the generated tiny model), so a GPU
        rehearsal verifies, copies and mounts them like ``vllm`` and the simulator checks their variant."""
        if engine.needs_weights:
            return True
        return spec.engine is EngineKind.SIM and bool(
            spec.source or spec.sources or model.name == TINY_MODEL_NAME
        )

    def _check_layout(self, spec: DeploymentSpec, rp: ReplicaPlan, index: int, engine: Engine | None) -> None:
        """A replica spanning nodes needs an engine and a launcher that join them (before any copy)."""
        nodes = list(dict.fromkeys(s.node for s in sorted(rp.shards, key=lambda s: s.pp_rank)))
        if len(nodes) <= 1:
            return
        if engine is not None and not engine.multi_node:
            raise UserError(
                f"replica {index} of {spec.name} needs pipeline stages on {len(nodes)} nodes "
                f"({', '.join(nodes)}), and the {spec.engine.value} engine runs a replica on one node",
                hint="plan onto nodes that hold a whole replica (llmctl plan --explain shows the "
                "layouts), or use an engine that joins nodes over Ray (vllm-cpu, sim)",
            )
        self._replica_launcher(rp.shards)  # no Ray launcher, or a node outside the fleet: refused now

    def _rows(self, rp: ReplicaPlan, index: int) -> list[Generation]:
        """The table rows of the replica's GPUs; each must run the planned variant."""
        rows: dict[str, Generation] = {}
        for shard in rp.shards:
            if not shard.gpus:
                continue
            try:
                node = self.fleet.node(shard.node)
            except KeyError:
                continue
            for gpu in node.gpus:
                if gpu.index not in shard.gpus:
                    continue
                row = self.compat.generation_for(gpu)
                if not row.supports(rp.quantization):
                    raise UserError(
                        f"replica {index}: {shard.node} GPU {gpu.index} ({gpu.model}) cannot run the "
                        f"{rp.quantization.value} variant: {row.why_not(rp.quantization)}",
                        hint="plan again (llmctl plan --explain), or choose a variant with --quantization",
                    )
                rows[row.name] = row
        return list(rows.values())

    def _checked_source(
        self, spec: DeploymentSpec, model: ModelSpec, variant: Quantization
    ) -> tuple[str, str | None]:
        """The source of ``variant`` and vLLM's method for it, read from its config.json (not copied)."""
        source = self._model_source(spec, model, variant)
        config = read_source_json(source)
        if config is None:
            return source, None
        fmt = checkpoint_format(config)
        if fmt.quantization is not variant:
            held = fmt.quantization.value if fmt.quantization is not None else "unknown"
            raise WeightsError(
                f"weights source {source} holds the {held} variant ({fmt.describe()}), "
                f"but the plan runs {model.name}'s {variant.value} variant",
                hint=f"give the {variant.value} weights with --source {variant.value}=PATH",
            )
        return source, fmt.method

    def cordoned(self) -> list[str]:
        """Names of the nodes cordoned in the state store (``llmctl cordon``), sorted."""
        return sorted(n.name for n in self.store.list_nodes() if not n.schedulable)

    def schedulable_fleet(self) -> Fleet:
        """The fleet without its cordoned nodes: what every new placement (deploy, scale, drain) sees."""
        off = set(self.cordoned())
        if not off:
            return self.fleet
        return self.fleet.model_copy(update={"nodes": [n for n in self.fleet.nodes if n.name not in off]})

    def no_room_reason(self, plan: Plan) -> str:
        """The planner's reasons for ``plan``'s unplaced replicas as one line, naming cordoned nodes."""
        reasons = "; ".join(r.strip().rstrip(":") for r in plan.reasons if r.strip()) or "no node can hold it"
        off = self.cordoned()
        return f"{reasons} (cordoned, not considered: {', '.join(off)})" if off else reasons

    def place_around(
        self, spec: DeploymentSpec, model: ModelSpec, count: int, members: list[ReplicaRecord]
    ) -> Plan:
        """Placement of ``count`` more replicas of ``spec`` on the schedulable nodes, around every replica
        in the store (their GPUs are taken, draining ones included) and away from the nodes of ``members``
        (the deployment's replicas that stay: anti-affinity)."""
        placed = [s for r in self.store.list_replicas() for s in r.shards]
        avoid = sorted({s.node for r in members for s in r.shards})
        want = spec.model_copy(update={"replicas": count})
        return self.planner(self.schedulable_fleet(), want, model, placed, avoid_nodes=avoid)

    def _plan(self, spec: DeploymentSpec, model: ModelSpec) -> Plan:
        placed = [s for r in self.store.list_replicas() if r.deployment != spec.name for s in r.shards]
        plan = self.planner(self.schedulable_fleet(), spec, model, placed)
        if plan.unplaced or len(plan.replicas) < spec.replicas:
            raise PlacementError(
                f"cannot place {spec.replicas} replica(s) of {model.name} with tp={spec.tp}: "
                f"{self.no_room_reason(plan)}"
            )
        return plan

    # --- deploy

    def deploy(
        self, spec: DeploymentSpec, *, wait: bool = True, timeout: float = 600.0, port: int | None = None
    ) -> DeployResult:
        """Bring ``spec`` to running. Idempotent; on any failure everything this call did is undone."""
        check_engine_args(spec)
        check_sources(spec)
        model = self.catalog.get(spec.model)
        previous = self.store.get_deployment(spec.name)
        if previous is not None and previous.spec != spec:
            if spec_version(previous.spec) != spec_version(spec):
                raise _conflict(previous.spec, spec)
            return self._update_in_place(previous, spec, wait=wait, timeout=timeout)
        loading: list[_Launched] = []
        if previous is not None:
            current = [r for r in self.refresh(spec.name) if r.state not in LEAVING_STATES]
            # A sleeping replica (scale to zero) runs: the controller wakes it, deploy leaves it be.
            ready = {r.index for r in current if r.state in {ReplicaState.READY, ReplicaState.SLEEPING}}
            # Replicas still loading (an earlier --no-wait) are awaited, never restarted.
            for r in current:
                launcher = self._launcher_for_record(r)
                if r.state is ReplicaState.STARTING and launcher is not None:
                    loading.append(_Launched(r, launcher))
            running = ready | {item.record.index for item in loading}
            plan = previous.plan
            # Failed and unhealthy replicas are started again in their planned slot; pending ones (no
            # room when they were asked for) and missing ones are placed anew by scale, below.
            broken = [r for r in current if r.index not in running and r.shards]
            todo = sorted(r.index for r in broken if r.index < len(plan.replicas))
            prepared = self._preflight(spec, model, plan, todo)
            short = spec.replicas - len(running) - len(todo)
            if not todo:
                if wait and loading:
                    self._await_ready(spec, loading, timeout)
                if short > 0:
                    return self._scale_from_deploy(spec, wait=wait, timeout=timeout)
                return DeployResult(
                    deployment=spec.name, changed=False, replicas=self.store.list_replicas(spec.name)
                )
            for rec in broken:
                self._stop_and_forget(rec)
            record = previous
        else:
            plan = self._plan(spec, model)
            todo = list(range(spec.replicas))
            prepared = self._preflight(spec, model, plan, todo)
            # The engine key: every replica of this deployment requires it on /v1/*; the gateway and
            # the probes read it from the store. Kept apart from the records ``llmctl status`` prints.
            self.store.put_engine_key(spec.name, SecretStr(secrets.token_urlsafe(32)))
            now = self.clock()
            record = DeploymentRecord(spec=spec, plan=plan, created_at=now, updated_at=now)
            short = 0

        self.launch(
            record,
            model,
            todo,
            previous=previous,
            wait=wait,
            timeout=timeout,
            port=port,
            prepared=prepared,
            loading=loading,
        )
        if short > 0:
            return self._scale_from_deploy(spec, wait=wait, timeout=timeout)
        if previous is None:
            record_event(
                self.store,
                "Deployed",
                f"{spec.replicas} replica(s) of {model.name} (tp={spec.tp}, {spec.engine.value})",
                deployment=spec.name,
                clock=self.clock,
            )
        replicas = self.store.list_replicas(spec.name)
        return DeployResult(deployment=spec.name, changed=True, replicas=replicas, notes=list(plan.notes))

    def _update_in_place(
        self, previous: DeploymentRecord, spec: DeploymentSpec, *, wait: bool, timeout: float
    ) -> DeployResult:
        """``llmctl deploy``/``apply`` of a running deployment that changes only :data:`IN_PLACE_FIELDS`:
        the bounds and scale-to-zero settings are written, then the replica count is scaled to."""
        settings = previous.spec.model_copy(
            update={k: getattr(spec, k) for k in IN_PLACE_FIELDS - {"replicas"}}
        )
        if settings == previous.spec:
            return self._scale_from_deploy(spec, wait=wait, timeout=timeout)
        before, after = previous.spec.model_dump(), settings.model_dump()
        changed = ", ".join(f"{k} {before[k]} -> {after[k]}" for k in sorted(after) if before[k] != after[k])
        self.store.put_deployment(previous.model_copy(update={"spec": settings, "updated_at": self.clock()}))
        record_event(self.store, "Updated", f"{changed} (in place)", deployment=spec.name, clock=self.clock)
        if spec.replicas != previous.spec.replicas:
            result = self._scale_from_deploy(spec, wait=wait, timeout=timeout)
            return result.model_copy(update={"changed": True, "notes": [f"updated {changed}", *result.notes]})
        return DeployResult(
            deployment=spec.name, changed=True, replicas=self.store.list_replicas(spec.name),
            notes=[f"updated {changed}"],
        )  # fmt: skip

    def _scale_from_deploy(self, spec: DeploymentSpec, *, wait: bool, timeout: float) -> DeployResult:
        """``llmctl deploy`` of a running deployment with another replica count: a scale in place."""
        from controlplane.controller.scaling import raise_unplaced, scale

        result = scale(self, spec.name, spec.replicas, reason="llmctl deploy", wait=wait, timeout=timeout)
        raise_unplaced(result)
        return DeployResult(
            deployment=spec.name,
            changed=result.changed,
            replicas=self.store.list_replicas(spec.name),
            notes=[result.describe()] if result.changed else [],
        )

    def launch(
        self,
        record: DeploymentRecord,
        model: ModelSpec,
        todo: list[int],
        *,
        previous: DeploymentRecord | None,
        wait: bool = True,
        timeout: float = 600.0,
        port: int | None = None,
        prepared: dict[int, _Prepared] | None = None,
        loading: list[_Launched] | None = None,
    ) -> list[ReplicaRecord]:
        """Record ``record`` as desired, then start its plan's replicas ``todo`` (slot = index) and await
        them; on any failure what this call started is stopped and ``previous`` restored (None: removed).
        Returns the records of the replicas started."""
        spec, plan = record.spec, record.plan
        if prepared is None:
            prepared = self._preflight(spec, model, plan, todo)
        # Desired state first (a crash from here on is visible), marked as being launched so that a
        # running controller does not start replicas of its own before these are recorded.
        marked = self._marked(record, timeout + LAUNCH_MARK_S)
        self.store.put_deployment(marked)
        launched: list[_Launched] = []
        try:
            self._launch_all(
                spec, model=model, plan=plan, todo=todo, port=port, launched=launched, prepared=prepared
            )
            if wait:
                self._await_ready(spec, [*launched, *(loading or [])], timeout)
        except BaseException as exc:
            self._rollback(spec, previous, launched)
            raise _rolled_back(spec, exc) from None
        self._unmark(marked)
        return [item.record for item in launched]

    def _marked(self, record: DeploymentRecord, for_s: float) -> DeploymentRecord:
        """``record`` marked as being launched by this deployer for ``for_s`` seconds from now: the
        controller leaves it alone meanwhile, and heals no replica of it that is still starting."""
        until = self.clock() + for_s
        return record.model_copy(update={"launching_until": until, "launching_by": self.marker})

    def _unmark(self, marked: DeploymentRecord) -> None:
        """Clear the launch mark of ``marked``'s deployment as stored now (the launch may have changed it)."""
        current = self.store.get_deployment(marked.name) or marked
        self.store.put_deployment(current.model_copy(update={"launching_until": 0.0, "launching_by": ""}))

    def _launch_all(
        self,
        spec: DeploymentSpec,
        *,
        model: ModelSpec,
        plan: Plan,
        todo: list[int],
        port: int | None,
        launched: list[_Launched],
        prepared: dict[int, _Prepared],
    ) -> None:
        engine = self.engines.get(spec.engine)
        if engine is None:
            raise LaunchError(f"engine {spec.engine.value} is not available in this build")
        weights: dict[str, str] = {}
        if self._lands_weights(spec, model, engine):
            weights = self._spread_weights(spec, model, plan, todo, prepared)
        for index in todo:
            rplan: ReplicaPlan = plan.replicas[index]
            shard0 = min(rplan.shards, key=lambda s: s.pp_rank)
            launcher = self._replica_launcher(rplan.shards)
            model_dir = None
            ready = prepared[index]
            if self._lands_weights(spec, model, engine):
                if shard0.node not in weights:
                    source = ready.source or self._model_source(spec, model, rplan.quantization)
                    self._say("weights", f"weights: verifying {model.name} on {shard0.node}")
                    path = launcher.ensure_weights(
                        source,
                        model.name,
                        policy=_policy(spec),
                        progress=lambda text: self._say("weights", text),
                    )
                    weights[shard0.node] = str(path)
                    self._say("weights", f"weights: {model.name} verified on {shard0.node}")
                model_dir = weights[shard0.node]
            node_spec = self._land_sources(spec, launcher)
            replica_id = f"{spec.name}-{index}"
            chosen = launcher.allocate_port(port + index if port is not None else None)
            ctx = ReplicaContext(
                replica_id=replica_id,
                spec=node_spec,
                served_model_name=spec.name,
                model_dir=model_dir,
                host=launcher.host,
                port=chosen,
                shards=rplan.shards,
                # Every GPU of the replica on the pp-rank-0 node: all its stages when pp stays in one node.
                gpu_ids=[g for s in rplan.shards if s.node == shard0.node for g in self._gpu_ids(s)],
                # None for a deployment made before engine keys (it keeps running without one).
                api_key=self.store.get_engine_key(spec.name),
                # Remote launchers run their node's interpreter (settings.remote_python), not ours.
                python=getattr(launcher, "python", None) or self.python,
                max_model_len=spec.max_model_len or model.max_model_len,
                gpu_memory_mib=self._gpu_memory_mib(shard0),
                planned_gpu_memory_mib=round(rplan.per_gpu_memory_gib * 1024) or None,
                replica=rplan,
                quantization_method=ready.quantization_method,
                image=ready.image,
                tool_call_parser=model.tool_call_parser if spec.tools else None,
                tool_chat_template=model.tool_chat_template if spec.tools else None,
            )
            launch = engine.build(ctx)
            stage_gpus: dict[str, list[str]] = {}
            for shard in rplan.shards:
                stage_gpus.setdefault(shard.node, []).extend(self._gpu_ids(shard))
            if any(stage_gpus.values()):
                launch = launch.model_copy(update={"stage_gpus": stage_gpus})
            now = self.clock()
            rec = ReplicaRecord(
                id=replica_id,
                deployment=spec.name,
                index=index,
                model=spec.name,
                engine=spec.engine,
                shards=rplan.shards,
                node=shard0.node,
                state=ReplicaState.STARTING,
                adapters=[a.name for a in spec.lora_adapters],
                weights=f"{model.name}/{PurePath(model_dir).name}" if model_dir else None,
                probes=launch.probes,
                version=spec_version(spec),
                created_at=now,
                updated_at=now,
            )
            self._say(replica_id, f"{replica_id}: starting {spec.engine.value} on {shard0.node}:{chosen}")
            # Recorded before it starts, without a handle or an endpoint (nothing probes it, nothing routes
            # to it): a deploy killed between the start and the next write leaves this record, not an
            # engine nobody knows of, and the controller stops whatever runs under the replica's name
            # (Reconciler._heal) instead of starting a second engine beside it.
            self.store.put_replica(rec)
            try:
                handle = launcher.start(replica_id, launch)
            except BaseException:
                # A start that raises leaves nothing running (each launcher cleans up after itself).
                self.store.delete_replica(replica_id)
                raise
            rec = rec.model_copy(update={"handle": handle, "endpoint": f"http://{launcher.host}:{chosen}"})
            launched.append(_Launched(rec, launcher))
            self.store.put_replica(rec)

    def _spread_weights(
        self,
        spec: DeploymentSpec,
        model: ModelSpec,
        plan: Plan,
        todo: list[int],
        prepared: dict[int, _Prepared],
    ) -> dict[str, str]:
        """Weights that two or more remote nodes need: verified here once, then spread node to node
        (:func:`~controlplane.weights.distribute.distribute`: one copy leaves this machine, every node
        holding a verified copy serves the next), not one copy from here per node. Returns the verified
        path for each replica's pp-rank-0 node whose nodes the spread covered; the other replicas take the
        per-node path (``launcher.ensure_weights``): one node, this host, and a node reached as a user
        other than root (the distribution works as root, see :meth:`SshLauncher.weights_peer`)."""
        from controlplane.launchers.ray import RayLauncher
        from controlplane.launchers.ssh import SshLauncher
        from controlplane.weights import ensure_weights
        from controlplane.weights.distribute import Peer, distribute

        # (source, node cache) → the replicas' pp-rank-0 nodes and every node that loads the weights
        # (each pipeline stage of a Ray replica loads its layers from its own node).
        groups: dict[tuple[str, str], list[tuple[str, list[SshLauncher]]]] = {}
        for index in todo:
            rplan = plan.replicas[index]
            launcher = self._replica_launcher(rplan.shards)
            nodes = list(launcher.stages) if isinstance(launcher, RayLauncher) else [launcher]
            ssh = [n for n in nodes if isinstance(n, SshLauncher)]
            if not ssh or len(ssh) != len(nodes):
                continue
            source = prepared[index].source or self._model_source(spec, model, rplan.quantization)
            shard0 = min(rplan.shards, key=lambda s: s.pp_rank).node
            groups.setdefault((source, str(ssh[0].remote_cache)), []).append((shard0, ssh))
        landed: dict[str, str] = {}
        for (source, _cache), replicas in groups.items():
            launchers = {n.node.name: n for _, nodes in replicas for n in nodes}
            if len(launchers) < 2:
                continue
            peers: dict[str, Peer] = {}
            for name, node in launchers.items():
                peer = node.weights_peer()
                if peer is not None:
                    peers[name] = peer
            if len(peers) < 2:
                continue
            first = launchers[next(iter(peers))]
            self._say("weights", f"weights: verifying {model.name} here")
            local = ensure_weights(
                source,
                model.name,
                first.local_cache,
                policy=_policy(spec),
                progress=lambda text: self._say("weights", text),
            )
            dest = first.remote_cache / model.name / local.name  # where SshLauncher.ensure_weights looks
            self._say("weights", f"weights: {model.name} verified here; spreading to {len(peers)} nodes")

            def by_node(text: str, names: Collection[str] = tuple(peers)) -> None:
                # distribute() says "weights: NODE: …": one updating line per node.
                node = next((n for n in names if text.startswith(f"weights: {n}: ")), None)
                self._say(f"weights {node}" if node else "weights", text)

            distribute(local, dest, list(peers.values()), progress=by_node)
            for shard0, nodes in replicas:
                if all(n.node.name in peers for n in nodes):
                    landed[shard0] = str(dest)
        return landed

    def _land_sources(self, spec: DeploymentSpec, launcher: Launcher) -> DeploymentSpec:
        """Copy the adapters and the draft model to the replica's nodes, verified, like the weights; the
        returned spec names their paths in the node's model cache (what the engine is given)."""
        policy = WeightsPolicy()
        adapters = [
            a.model_copy(
                update={
                    "source": str(
                        launcher.ensure_weights(a.source, f"{spec.model}-lora-{a.name}", policy=policy)
                    )
                }
            )
            if a.source is not None
            else a
            for a in spec.lora_adapters
        ]
        speculative = spec.speculative
        if speculative is not None and speculative.model is not None:
            draft = launcher.ensure_weights(speculative.model, f"{spec.model}-draft", policy=_policy(spec))
            speculative = speculative.model_copy(update={"model": str(draft)})
        return spec.model_copy(update={"lora_adapters": adapters, "speculative": speculative})

    def _gpu_memory_mib(self, shard: Shard) -> int | None:
        """The smallest memory among the shard's GPUs (what the engine's budget must fit)."""
        try:
            node = self.fleet.node(shard.node)
        except KeyError:
            return None
        sizes = [g.memory_total_mib for g in node.gpus if g.index in shard.gpus]
        return min(sizes) if sizes else None

    def _gpu_ids(self, shard: Shard) -> list[str]:
        try:
            node = self.fleet.node(shard.node)
        except KeyError:
            return [str(i) for i in shard.gpus]
        by_index = {g.index: g.uuid for g in node.gpus}
        return [by_index.get(i) or str(i) for i in shard.gpus]

    def _await_ready(self, spec: DeploymentSpec, launched: list[_Launched], timeout: float) -> None:
        deadline = self.clock() + timeout
        pending = list(launched)
        started = self.clock()
        while pending:
            for item in list(pending):
                rec = item.record
                proc = item.launcher.poll(rec.handle)
                # A restart while loading is a crash during start-up too (the supervisor hides it).
                if proc.state is not ProcessState.RUNNING or proc.restarts:
                    last = last_error_line(item.launcher.logs(rec.handle, tail=40)) or "no output"
                    code = f" with code {proc.exit_code}" if proc.exit_code is not None else ""
                    log = rec.handle.get("log", "")
                    raise LaunchError(
                        f"replica {rec.id} exited{code} during start-up: {last}",
                        hint=f"full log: {log}" if log else None,
                    )
                key = self.store.get_engine_key(rec.deployment)
                if _http_check(f"{rec.endpoint}{rec.probes.ready}", key) is None:
                    rec.state = ReplicaState.READY
                    rec.updated_at = self.clock()
                    rec.message = ""
                    self.store.put_replica(rec)
                    pending.remove(item)
                    self._say(rec.id, f"{rec.id}: ready at {rec.endpoint}")
                else:
                    waited = int(self.clock() - started)
                    # Every 15 s: without a terminal each progress update is a printed line.
                    if waited // 15 != item.last_said:
                        item.last_said = waited // 15
                        self._say(rec.id, f"{rec.id}: waiting for {spec.engine.value} to load ({waited}s)")
            if not pending:
                return
            if self.clock() > deadline:
                ids = ", ".join(i.record.id for i in pending)
                raise LaunchError(
                    f"{ids} not ready after {timeout:.0f}s",
                    hint="raise --timeout, or read `llmctl logs REPLICA`",
                )
            self.sleep(1.0)

    def _stop_and_forget(self, rec: ReplicaRecord) -> None:
        self.stop_process(rec)
        self.store.delete_replica(rec.id)

    def check_reach(self, replicas: list[ReplicaRecord], command: str) -> None:
        """Refuse, before anything changes, to act on a replica whose process this host cannot reach."""
        for rec in replicas:
            if rec.handle and self._launcher_for_record(rec) is None:
                raise LaunchError(
                    f"replica {rec.id} runs on {rec.handle.get('host', rec.node)}, out of this host's reach",
                    hint=f"run `llmctl {command}` there",
                )

    def stop_replica(self, rec: ReplicaRecord) -> None:
        """Mark ``rec`` stopping, stop its process (when it has one) and remove its record."""
        rec.state, rec.updated_at = ReplicaState.STOPPING, self.clock()
        self.store.put_replica(rec)
        self._say(rec.id, f"{rec.id}: stopping")
        self.stop_process(rec)
        self.store.delete_replica(rec.id)

    def _rollback(
        self, spec: DeploymentSpec, previous: DeploymentRecord | None, launched: list[_Launched]
    ) -> None:
        """Stop what this deploy started and restore the desired state as it was before."""
        errors: list[str] = []
        for item in reversed(launched):
            try:
                item.launcher.stop(item.record.handle)
            except SarvError as exc:
                errors.append(str(exc))
            self.store.delete_replica(item.record.id)
        if previous is None:
            self.store.delete_deployment(spec.name)
            self.store.delete_engine_key(spec.name)
        else:
            self.store.put_deployment(previous)
        if errors:
            raise LaunchError(f"rollback of {spec.name} incomplete: {'; '.join(errors)}")

    # --- healing: one replica at a time (the controller)

    def poll(self, rec: ReplicaRecord) -> ReplicaProcess | None:
        """What the replica's launcher sees of its process; None when no launcher here can reach it."""
        launcher = self._launcher_for_record(rec)
        if launcher is None or not rec.handle:
            return None
        return launcher.poll(rec.handle)

    def stop_process(self, rec: ReplicaRecord) -> None:
        """Stop the replica's process and leave the store alone (its record may already name a successor
        with the same id), where a launcher here can reach it. A record without a handle (its start never
        returned one) has whatever runs under its name stopped."""
        stoppable = self._stoppable(rec)
        if stoppable is not None:
            launcher, handle = stoppable
            launcher.stop(handle)

    def relaunch(self, name: str, index: int, *, avoid: frozenset[str] = frozenset()) -> ReplicaRecord:
        """Start replica ``index`` of ``name`` again, without waiting for it to load; its old process is
        stopped and its record replaced (``starting``). Where its stored placement uses a node in
        ``avoid`` it is placed anew around every other replica on the fleet less those nodes (a
        pipeline-parallel replica moves as a whole); no room raises :class:`PlacementError`."""
        record = self.store.get_deployment(name)
        if record is None:
            raise NotFoundError(f"no deployment named {name!r}")
        old = self.store.get_replica(f"{name}-{index}")
        spec = self._spec_of(record, old)
        model = self.catalog.get(spec.model)
        plan = record.plan
        placed = plan.replicas[index] if index < len(plan.replicas) else None
        if placed is None or any(s.node in avoid for s in placed.shards):
            plan = self._replace_placement(record, model, index, avoid, spec)
        prepared = self._preflight(spec, model, plan, [index])
        if old is not None:
            try:
                self.stop_process(old)
            except SarvError as exc:
                # A lost node cannot be reached: its process is stopped when it answers again.
                self._say(old.id, f"{old.id}: could not stop the old process: {exc}")
            self.store.delete_replica(old.id)
        launched: list[_Launched] = []
        self._launch_all(
            spec, model=model, plan=plan, todo=[index], port=None, launched=launched, prepared=prepared
        )
        return launched[0].record

    def _spec_of(self, record: DeploymentRecord, rec: ReplicaRecord | None) -> DeploymentSpec:
        """The spec replica ``rec`` runs: its rollout's canary when it is one, else the deployment's."""
        if rec is not None and rec.version and rec.version != spec_version(record.spec):
            rollout = self.store.get_rollout(record.name)
            if rollout is not None and rollout.active and rollout.canary_version == rec.version:
                return rollout.canary.model_copy(update={"replicas": record.spec.replicas})
        return record.spec

    def start_version(
        self, record: DeploymentRecord, spec: DeploymentSpec, index: int, placement: ReplicaPlan
    ) -> ReplicaRecord:
        """Start replica ``index`` of ``record``'s deployment running ``spec`` (a rollout's version) at
        ``placement``, without waiting for it to load. The placement is recorded in the plan's slot; the
        desired spec stays ``record``'s. What this call started is stopped again on any failure."""
        model = self.catalog.get(spec.model)
        slots = list(record.plan.replicas)
        while len(slots) <= index:
            slots.append(placement)
        slots[index] = placement
        plan = record.plan.model_copy(update={"replicas": slots})
        prepared = self._preflight(spec, model, plan, [index])
        # Marked while it launches (``llmctl rollout`` calls this too): the controller must not take the
        # replica, recorded before its start returns, for one a killed launch left behind.
        marked = self._marked(
            record.model_copy(update={"plan": plan, "updated_at": self.clock()}), LAUNCH_MARK_S
        )
        self.store.put_deployment(marked)
        launched: list[_Launched] = []
        try:
            self._launch_all(
                spec, model=model, plan=plan, todo=[index], port=None, launched=launched, prepared=prepared
            )
        except BaseException:
            for item in launched:
                item.launcher.stop(item.record.handle)
                self.store.delete_replica(item.record.id)
            raise
        finally:
            self._unmark(marked)
        return launched[0].record

    def _replace_placement(
        self,
        record: DeploymentRecord,
        model: ModelSpec,
        index: int,
        avoid: frozenset[str],
        spec: DeploymentSpec,
    ) -> Plan:
        """``record``'s plan with replica ``index`` (running ``spec``) placed anew off ``avoid``; stored
        before it returns."""
        own = f"{spec.name}-{index}"
        others = [r for r in self.store.list_replicas() if r.id != own]
        taken = [s for r in others for s in r.shards]
        schedulable = self.schedulable_fleet()
        fleet = schedulable.model_copy(
            update={"nodes": [n for n in schedulable.nodes if n.name not in avoid]}
        )
        mates = sorted({s.node for r in others if r.deployment == spec.name for s in r.shards})
        one = self.planner(fleet, spec.model_copy(update={"replicas": 1}), model, taken, avoid_nodes=mates)
        if one.unplaced or not one.replicas:
            raise PlacementError(
                f"no room for replica {own} off {', '.join(sorted(avoid))}: {self.no_room_reason(one)}"
            )
        replicas = list(record.plan.replicas)
        while len(replicas) <= index:
            replicas.append(one.replicas[0])
        replicas[index] = one.replicas[0]
        plan = record.plan.model_copy(update={"replicas": replicas})
        self.store.put_deployment(record.model_copy(update={"plan": plan, "updated_at": self.clock()}))
        return plan

    # --- observe, undeploy, logs

    def refresh(
        self, deployment: str | None = None, *, rule: HealthRule | None = None
    ) -> list[ReplicaRecord]:
        """Update replicas' observed state from their processes and probes; return them."""
        return [o.record for o in self.observe(deployment, rule=rule)]

    def observe(self, deployment: str | None = None, *, rule: HealthRule | None = None) -> list[Observation]:
        """Poll each replica this host can reach and probe it once, recording what that proves.

        A process that is gone makes its replica ``failed``. A probe goes through the controller's health
        rule (``rule``; default: the controller's default thresholds) from an empty streak: one look can
        take a loading replica to ``ready`` but never a ready one to ``unhealthy`` unless a single failure
        is the threshold. The probe's outcome is returned either way.
        """
        rule = rule or HealthRule()
        out: list[Observation] = []
        for rec in self.store.list_replicas(deployment):
            launcher = self._launcher_for_record(rec)
            if launcher is None or rec.state in LEAVING_STATES:
                out.append(Observation(rec))
                continue
            proc = launcher.poll(rec.handle) if rec.handle else None
            new_state: ReplicaState = rec.state
            message = rec.message
            path: str | None = None
            error: str | None = None
            if proc is None or proc.state is not ProcessState.RUNNING:
                new_state = ReplicaState.FAILED
                code = f" (exit code {proc.exit_code})" if proc and proc.exit_code is not None else ""
                # Already failed: keep the account given then (the controller's crash loop, its back-off).
                if rec.state is not ReplicaState.FAILED or not rec.message:
                    message = f"process {rec.handle.get('pid', '?')} is not running{code}"
            elif rec.endpoint and rec.state in PROBED_STATES:
                path = probe_path(rec)
                error = _http_check(f"{rec.endpoint}{path}", self.store.get_engine_key(rec.deployment))
                verdict = judge(rule, rec.state, rec.message, ok=error is None, error=error or "")
                new_state, message = verdict.state, verdict.message
                if error is None and new_state is ReplicaState.READY and proc.restarts:
                    message = f"restarted {proc.restarts}× after crashes (last exit code {proc.exit_code})"
            if (new_state, message) != (rec.state, rec.message):
                rec.state, rec.message, rec.updated_at = new_state, message, self.clock()
                self.store.put_replica(rec)
            out.append(Observation(rec, path, error))
        return out

    def undeploy(self, name: str) -> list[str]:
        """Stop every replica of ``name`` and remove it from the state; returns the replica ids stopped."""
        record = self.store.get_deployment(name)
        replicas = self.store.list_replicas(name)
        if record is None and not replicas:
            known = ", ".join(d.name for d in self.store.list_deployments()) or "none"
            raise NotFoundError(f"no deployment named {name!r} (deployments: {known})")
        stopped: list[str] = []
        for rec in replicas:
            self.check_reach([rec], "undeploy")
            self.stop_replica(rec)
            stopped.append(rec.id)
        self.store.delete_deployment(name)
        self.store.delete_engine_key(name)
        self.store.delete_rollout(name)
        record_event(
            self.store,
            "Undeployed",
            f"stopped {', '.join(stopped) or 'no replica'}",
            deployment=name,
            clock=self.clock,
        )
        return stopped

    def logs(self, replica_id: str, *, follow: bool = False, tail: int = 200) -> Iterator[str]:
        rec = self.store.get_replica(replica_id)
        if rec is None:
            known = ", ".join(r.id for r in self.store.list_replicas()) or "none"
            raise NotFoundError(f"no replica named {replica_id!r} (replicas: {known})")
        launcher = self._launcher_for_record(rec)
        if launcher is None:
            raise LaunchError(f"replica {rec.id} runs on {rec.node}; read its log there")
        return launcher.logs(rec.handle, follow=follow, tail=tail)


def check_sources(spec: DeploymentSpec) -> None:
    """Refuse a missing or unverifiable LoRA adapter or draft model, or an adapter of too high a rank,
    before the deployment is recorded and before any byte is copied or any replica started."""
    from controlplane.weights.adapters import DEFAULT_MAX_LORA_RANK, check_adapter_source, check_draft_source

    raw_rank = spec.engine_args.get("max_lora_rank", DEFAULT_MAX_LORA_RANK)
    try:
        max_rank = int(raw_rank)
    except ValueError:
        raise UserError(f"max_lora_rank {raw_rank!r} is not an integer") from None
    for adapter in spec.lora_adapters:
        if adapter.source is not None:
            check_adapter_source(adapter.name, adapter.source, max_lora_rank=max_rank)
    if spec.speculative is not None and spec.speculative.model is not None:
        check_draft_source(spec.speculative.model)


def _conflict(old: DeploymentSpec, new: DeploymentSpec) -> UserError:
    before = old.model_dump()
    changed = sorted(k for k, v in new.model_dump().items() if before.get(k) != v)
    return UserError(
        f"deployment {new.name} already exists with different {', '.join(changed)}",
        hint=f"roll the change out with `llmctl rollout {new.name} --set KEY=VALUE` or `llmctl apply`, "
        "or pick another --name",
    )


def _rolled_back(spec: DeploymentSpec, exc: BaseException) -> BaseException:
    """The error to report after a rollback: launch failures say so; bad input stays as it was."""
    if isinstance(exc, LaunchError):
        return type(exc)(f"{exc.message}; the deploy was rolled back", hint=exc.hint)
    if isinstance(exc, KeyboardInterrupt):
        return LaunchError(f"deploy of {spec.name} interrupted; the deploy was rolled back")
    return exc
