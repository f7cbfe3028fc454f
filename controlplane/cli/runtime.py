"""`llmctl` commands: runtime (deploy, status, undeploy, logs)."""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controlplane.cli import ui
from controlplane.cli.options import optional_path
from controlplane.errors import UserError
from controlplane.spec import (
    DeploymentSpec,
    Dtype,
    EngineKind,
    LoraAdapter,
    Quantization,
    ReplicaRecord,
    SpeculativeConfig,
)

if TYPE_CHECKING:
    from controlplane.controller import Deployer, Observation
    from controlplane.settings import Settings
    from controlplane.spec import Fleet
    from controlplane.state.base import StateStore

__all__ = ["STATUS_EVENTS", "register", "status_document", "wire_deployer"]

STATUS_EVENTS = 3
"""Latest events per deployment that ``llmctl status`` shows."""


class StatusFormat(StrEnum):
    TABLE = "table"
    JSON = "json"


class EngineChoice(StrEnum):
    AUTO = "auto"
    VLLM = "vllm"
    VLLM_CPU = "vllm-cpu"
    SIM = "sim"


InventoryOpt = Annotated[
    Path | None,
    typer.Option(
        "--inventory",
        "-i",
        parser=optional_path,
        metavar="PATH",
        help="Ansible inventory or fleet file (default: SARV_INVENTORY, else this host).",
    ),
]


def _parse_value(text: str) -> str | int | float | bool:
    low = text.lower()
    if low in {"true", "yes", "on"}:
        return True
    if low in {"false", "no", "off"}:
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _engine_args(pairs: list[str]) -> dict[str, str | int | float | bool]:
    out: dict[str, str | int | float | bool] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise UserError(f"--engine-arg {pair!r} must be KEY=VALUE (e.g. max_num_seqs=64)")
        out[key.strip().replace("-", "_")] = _parse_value(value.strip())
    return out


def _sources(values: list[str]) -> tuple[str | None, dict[Quantization, str]]:
    """``--source PATH`` (the planned variant's) and ``--source VARIANT=PATH`` entries."""
    plain: str | None = None
    variants: dict[Quantization, str] = {}
    names = {q.value for q in Quantization}
    for value in values:
        head, eq, tail = value.partition("=")
        if eq and head in names:
            variant = Quantization(head)
            if variant is Quantization.AUTO or not tail:
                raise UserError(
                    f"--source {value!r}: give VARIANT=PATH with a variant of none, fp8, int8, awq, gptq"
                )
            if variant in variants:
                raise UserError(f"--source {head}= is given twice")
            variants[variant] = tail
        elif plain is not None:
            raise UserError("--source PATH is given twice; give other variants as VARIANT=PATH")
        else:
            plain = value
    return plain, variants


def wire_deployer(settings: Settings, store: StateStore, fleet: Fleet, *, progress: Any = None) -> Deployer:
    """A Deployer on ``store`` and ``fleet``: the catalog, placement and launchers the settings name."""
    from controlplane.catalog import Catalog
    from controlplane.controller import Deployer, default_engines
    from controlplane.launchers import group_launcher_for, is_local_node, launcher_for
    from controlplane.placement import place

    return Deployer(
        settings=settings,
        store=store,
        fleet=fleet,
        catalog=Catalog.load(settings.catalog),
        # The placement `llmctl plan` prints, told which node is this host and its core count.
        planner=functools.partial(place, is_local=is_local_node, local_cpus=os.cpu_count()),
        launcher_factory=lambda node: launcher_for(
            node, settings.home, settings.resolved_model_cache, settings=settings
        ),
        # Replicas whose pipeline stages span nodes: a Ray cluster over SSH (launchers/ray.py).
        group_launcher_factory=lambda nodes: group_launcher_for(
            nodes, settings.resolved_model_cache, settings
        ),
        engines=default_engines(settings),
        progress=progress,
        python=sys.executable,
    )


@contextmanager
def _deployer(inventory: Path | None, *, progress: Any = None) -> Iterator[Deployer]:
    """A Deployer wired from the settings: state store, fleet, catalog, placement and launchers."""
    from controlplane.fleet import load_fleet
    from controlplane.settings import load_settings
    from controlplane.state import open_store

    settings = load_settings(inventory=inventory)
    store = open_store(settings.resolved_state_url, settings)
    try:
        yield wire_deployer(settings, store, load_fleet(settings.inventory), progress=progress)
    finally:
        store.close()


def _age(ts: float, now: float) -> str:
    if not ts:
        return "-"
    s = max(0, int(now - ts))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h" if s < 172800 else f"{s // 86400}d"


def status_document(deployer: Deployer) -> dict[str, Any]:
    """The JSON contract of ``llmctl status -o json``: deployments, each with its replicas."""
    by_dep: dict[str, list[Observation]] = {}
    for o in deployer.observe():
        by_dep.setdefault(o.record.deployment, []).append(o)
    deployments = []
    for d in deployer.store.list_deployments():
        reps = sorted(by_dep.pop(d.name, []), key=lambda o: o.record.index)
        deployments.append(
            {
                "name": d.name,
                "model": d.spec.model,
                "engine": d.spec.engine.value,
                "desired_replicas": d.spec.replicas,
                "tp": d.spec.tp,
                "pp": d.spec.pp or 1,
                "created_at": d.created_at,
                "replicas": [_replica_doc(r) for r in reps],
            }
        )
    # Replicas without a desired deployment (a crashed deploy) are shown, not hidden.
    for name, reps in sorted(by_dep.items()):
        deployments.append({"name": name, "orphaned": True, "replicas": [_replica_doc(r) for r in reps]})
    for doc in deployments:
        recent = deployer.store.list_events(str(doc["name"]), limit=STATUS_EVENTS)
        doc["events"] = [e.model_dump(mode="json") for e in recent]
    cordoned = [n.model_dump(mode="json") for n in deployer.store.list_nodes() if not n.schedulable]
    return {"deployments": deployments, "cordoned": cordoned}


def _replica_doc(o: Observation) -> dict[str, Any]:
    r = o.record
    return {
        "id": r.id,
        "index": r.index,
        "model": r.model,
        "engine": r.engine.value,
        "node": r.node,
        # GPUs on ``node`` (pp rank 0); ``shards`` lists every stage's node and GPUs.
        "gpus": sorted({g for s in r.shards if s.node == r.node for g in s.gpus}),
        "shards": [s.model_dump() for s in sorted(r.shards, key=lambda s: s.pp_rank)],
        "state": r.state.value,
        "endpoint": r.endpoint,
        "adapters": r.adapters,
        "pid": int(r.handle["pid"]) if r.handle.get("pid", "").isdigit() else None,
        "log": r.handle.get("log"),
        "message": r.message,
        # This look's probe; the health rule alone decides whether it changes ``state``.
        "probe": None if o.probed is None else {"path": o.probed, "ok": o.error is None, "error": o.error},
        "created_at": r.created_at,
        "updated_at": r.updated_at,
    }


def _print_endpoints(replicas: list[ReplicaRecord]) -> None:
    for r in sorted(replicas, key=lambda r: r.index):
        ui.out(f"  {r.id}  {r.state.value:<9} {r.endpoint or '-'}")


def _status_rows(doc: dict[str, Any], now: float) -> list[list[str]]:
    rows: list[list[str]] = []
    for d in doc["deployments"]:
        for r in d["replicas"] or [None]:
            if r is None:
                rows.append([d["name"], "-", "-", "-", "no replicas", "-", "-"])
                continue
            stages = [sh for sh in r["shards"] if sh["gpus"]]
            if len({sh["node"] for sh in stages}) > 1:
                gpus = " ".join(f"{sh['node']}:{','.join(map(str, sh['gpus']))}" for sh in stages)
            else:
                gpus = ",".join(map(str, r["gpus"])) or "cpu"
            state = r["state"] + (f" ({r['message']})" if r["message"] else "")
            probe = r["probe"]
            if probe is not None and not probe["ok"]:
                state += f" [{probe['path']}: {probe['error']}]"
            rows.append(
                [
                    d["name"],
                    r["id"],
                    r["node"] or "-",
                    gpus if r["node"] else "-",
                    state,
                    r["endpoint"] or "-",
                    _age(r["created_at"], now),
                ]
            )
    return rows


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""

    @app.command()
    def deploy(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        model: Annotated[str, typer.Argument(help="Catalog model name (see `llmctl models`).")],
        name: Annotated[str | None, typer.Option(help="Deployment name (default: the model name).")] = None,
        tp: Annotated[int, typer.Option(help="Tensor-parallel size (GPUs per pipeline stage).")] = 1,
        pp: Annotated[int | None, typer.Option(help="Pipeline-parallel size (default: 1).")] = None,
        replicas: Annotated[int, typer.Option(help="Number of replicas.")] = 1,
        min_replicas: Annotated[
            int | None,
            typer.Option(min=1, max=1024, help="Fewest replicas the controller may scale down to."),
        ] = None,
        max_replicas: Annotated[
            int | None,
            typer.Option(min=1, max=1024, help="Most replicas the controller may scale up to."),
        ] = None,
        scale_to_zero: Annotated[
            bool | None,
            typer.Option(
                "--scale-to-zero/--no-scale-to-zero",
                help="After --idle-timeout without a request the controller takes it to zero (asleep with "
                "--engine-arg enable_sleep_mode=true, else stopped); the gateway holds requests meanwhile.",
            ),
        ] = None,
        idle_timeout: Annotated[
            float | None,
            typer.Option(min=1, max=7 * 86_400, help="Seconds without a request before scale to zero."),
        ] = None,
        engine: Annotated[
            EngineChoice,
            typer.Option(help="vllm (GPU container), vllm-cpu, sim; auto: vllm with GPUs, else vllm-cpu."),
        ] = EngineChoice.AUTO,
        wait: Annotated[
            bool, typer.Option("--wait/--no-wait", help="Wait until every replica is ready.")
        ] = True,
        timeout: Annotated[float, typer.Option(help="Seconds to wait for readiness.")] = 900.0,
        source: Annotated[
            list[str] | None,
            typer.Option(
                help="Weights: a directory or http(s)/s3 URL with a SHA256SUMS manifest, for the planned "
                "variant; VARIANT=PATH (e.g. fp8=/srv/llama-fp8) for one variant (repeatable)."
            ),
        ] = None,
        tools: Annotated[
            bool,
            typer.Option(
                "--tools/--no-tools",
                help="Tool calling (OpenAI `tools`), with the catalog's tool-call parser for the model.",
            ),
        ] = False,
        port: Annotated[
            int | None, typer.Option(help="First replica's port (default: any free port).")
        ] = None,
        max_model_len: Annotated[int | None, typer.Option(help="Context length.")] = None,
        gpu_memory_utilization: Annotated[
            float, typer.Option(help="Fraction of GPU memory vLLM may use.")
        ] = 0.9,
        quantization: Annotated[Quantization, typer.Option(help="Weight format.")] = Quantization.NONE,
        kv_cache_dtype: Annotated[str, typer.Option(help="KV cache dtype (auto, fp8 …).")] = "auto",
        dtype: Annotated[Dtype, typer.Option(help="Activation dtype.")] = Dtype.BF16,
        max_num_seqs: Annotated[int | None, typer.Option(help="Sequences decoded at once.")] = None,
        max_num_batched_tokens: Annotated[int | None, typer.Option(help="Tokens per scheduler step.")] = None,
        enable_prefix_caching: Annotated[
            bool | None, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching")
        ] = None,
        lora_module: Annotated[
            list[str] | None, typer.Option(help="LoRA adapter NAME=PATH (repeat for several).")
        ] = None,
        speculative_config: Annotated[
            str | None, typer.Option(help='"ngram[:N]", "draft:MODEL[:N]" or a JSON object.')
        ] = None,
        engine_arg: Annotated[
            list[str] | None,
            typer.Option(help="Other engine option KEY=VALUE (repeat), e.g. enforce_eager=true."),
        ] = None,
        inventory: InventoryOpt = None,
        output: Annotated[StatusFormat, typer.Option("--output", "-o")] = StatusFormat.TABLE,
    ) -> None:
        """Plan, launch and await replicas of MODEL; a failed launch is rolled back."""
        args = _engine_args(engine_arg or [])
        for key, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("enable_prefix_caching", enable_prefix_caching),
        ):
            if value is not None:
                args[key] = value
        # --engine-arg lora-modules=… / speculative-config=… are lifted into these by DeploymentSpec.
        adapters = [a for m in lora_module or [] for a in LoraAdapter.parse_list(m)]
        speculative = SpeculativeConfig.parse(speculative_config) if speculative_config is not None else None
        plain, per_variant = _sources(source or [])
        with ui.progress() as bar, _deployer(inventory, progress=bar.update) as deployer:
            kind = EngineKind(engine.value) if engine is not EngineChoice.AUTO else None
            if kind is None:
                from controlplane.placement import choose_engine

                kind, why = choose_engine(deployer.fleet)
                bar.update("engine", f"engine: {kind.value} ({why})")
            canonical = deployer.catalog.get(model).name  # aliases deploy as the model they name
            spec = DeploymentSpec(
                name=name or canonical,
                model=canonical,
                replicas=replicas,
                min_replicas=min_replicas,
                max_replicas=max_replicas,
                scale_to_zero=scale_to_zero,
                idle_timeout_s=idle_timeout,
                tp=tp,
                pp=pp,
                quantization=quantization,
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                engine=kind,
                engine_args=args,
                lora_adapters=adapters,
                speculative=speculative,
                source=plain,
                sources=per_variant,
                tools=tools,
            )
            from controlplane.cli.audit import audited

            with audited(deployer.store, "deploy", spec.name, {"model": str(spec.model)}):
                result = deployer.deploy(spec, wait=wait, timeout=timeout, port=port)
        if output is StatusFormat.JSON:
            ui.print_json(result.model_dump(mode="json"))
            return
        verb = "deployed" if result.changed else "unchanged (already running as asked)"
        ui.out(f"{result.deployment}: {verb}")
        _print_endpoints(result.replicas)

    _register_operations(app)
    _register_lora(app)


def _register_operations(app: typer.Typer) -> None:
    """``llmctl status``, ``undeploy`` and ``logs``."""

    @app.command()
    def status(
        output: Annotated[StatusFormat, typer.Option("--output", "-o", help="table or json (stable).")] = (
            StatusFormat.TABLE
        ),
        inventory: InventoryOpt = None,
    ) -> None:
        """Deployments and their replicas: node, GPUs, state, endpoint, age."""
        with _deployer(inventory) as deployer:
            doc = status_document(deployer)
        if output is StatusFormat.JSON:
            ui.print_json(doc)
            return
        now = time.time()
        rows = _status_rows(doc, now)
        if not rows:
            ui.out("no deployments")
        else:
            ui.table(["DEPLOYMENT", "REPLICA", "NODE", "GPUS", "STATE", "ENDPOINT", "AGE"], rows)
        events = [
            [d["name"], _age(e["at"], now), e["type"], e["reason"], e["object"] or "-", e["message"]]
            for d in doc["deployments"]
            for e in d["events"]
        ]
        if events:
            ui.out()
            ui.table(
                ["DEPLOYMENT", "AGE", "TYPE", "REASON", "OBJECT", "MESSAGE"], events, title="Recent events"
            )
        for node in doc["cordoned"]:
            why = f" ({node['reason']})" if node["reason"] else ""
            ui.out(f"node {node['name']}: cordoned{why}, no new replicas")

    @app.command()
    def undeploy(
        name: Annotated[str, typer.Argument(help="Deployment name.")],
        inventory: InventoryOpt = None,
        yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    ) -> None:
        """Stop every replica of a deployment and remove it (asks first on a terminal, unless --yes)."""
        if not ui.confirm(f"undeploy {name!r} and stop all its replicas?", assume_yes=yes):
            ui.out("nothing changed")
            raise typer.Exit(1)
        with ui.progress() as bar, _deployer(inventory, progress=bar.update) as deployer:
            from controlplane.cli.audit import audited

            with audited(deployer.store, "undeploy", name):
                stopped = deployer.undeploy(name)
        ui.out(f"{name}: undeployed ({len(stopped)} replica{'s' if len(stopped) != 1 else ''} stopped)")

    @app.command()
    def logs(
        replica: Annotated[str, typer.Argument(help="Replica id, e.g. sarv-tiny-0 (see `llmctl status`).")],
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
        tail: Annotated[int, typer.Option(help="Lines of history to print first (0: all).")] = 200,
        inventory: InventoryOpt = None,
    ) -> None:
        """Print a replica's log."""
        with _deployer(inventory) as deployer:
            try:
                for line in deployer.logs(replica, follow=follow, tail=tail):
                    ui.out(line)
            except KeyboardInterrupt:
                return


def _register_lora(app: typer.Typer) -> None:
    """``llmctl lora list|add|remove``."""
    lora = typer.Typer(help="LoRA adapters of a running deployment: list, add, remove.", no_args_is_help=True)
    app.add_typer(lora, name="lora")

    @lora.command("list")
    def lora_list(
        deployment: Annotated[str, typer.Argument(help="Deployment name.")],
        inventory: InventoryOpt = None,
    ) -> None:
        """The adapters a deployment serves (its desired state)."""
        from controlplane.controller.adapters import AdapterManager

        with _deployer(inventory) as deployer:
            adapters = AdapterManager(deployer).adapters(deployment)
        if not adapters:
            ui.out(f"{deployment}: no LoRA adapters")
            return
        ui.table(["ADAPTER", "SOURCE"], [[a.name, a.source or "-"] for a in adapters])

    @lora.command("add")
    def lora_add(
        deployment: Annotated[str, typer.Argument(help="Deployment name.")],
        name: Annotated[str, typer.Argument(help="Adapter name, routable as a model.")],
        source: Annotated[str, typer.Option(help="Adapter directory (or URL) with a SHA256SUMS manifest.")],
        inventory: InventoryOpt = None,
    ) -> None:
        """Verify, copy and load an adapter on every replica (or on none)."""
        from controlplane.controller.adapters import AdapterManager

        with _deployer(inventory) as deployer:
            ids = AdapterManager(deployer).add(deployment, name, source)
        ui.out(f"{deployment}: adapter {name} loaded on {', '.join(ids)}")

    @lora.command("remove")
    def lora_remove(
        deployment: Annotated[str, typer.Argument(help="Deployment name.")],
        name: Annotated[str, typer.Argument(help="Adapter name.")],
        inventory: InventoryOpt = None,
    ) -> None:
        """Unload an adapter from every replica and from the deployment's desired state."""
        from controlplane.controller.adapters import AdapterManager

        with _deployer(inventory) as deployer:
            ids = AdapterManager(deployer).remove(deployment, name)
        ui.out(f"{deployment}: adapter {name} removed from {', '.join(ids)}")
