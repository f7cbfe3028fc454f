"""`llmctl` commands: planning (``llmctl plan``)."""

from __future__ import annotations

import os
import re
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controlplane.cli import ui
from controlplane.cli.options import optional_path
from controlplane.cli.runtime import EngineChoice
from controlplane.errors import PlacementError
from controlplane.spec import Quantization, Strategy

if TYPE_CHECKING:
    from controlplane.spec import DeploymentSpec, Fleet, ModelSpec, Plan

__all__ = ["PlanOutput", "register"]


class PlanOutput(StrEnum):
    TABLE = "table"
    JSON = "json"


def _deployment_name(model: str) -> str:
    return re.sub(r"[^a-z0-9.-]+", "-", model.lower()).strip("-.")[:63] or "model"


def _print_table(plan: Plan, fleet: Fleet, spec: DeploymentSpec, source: str) -> None:
    from controlplane.placement import link_name

    nodes = {n.name: n for n in fleet.nodes}
    rows: list[list[object]] = []
    for i, replica in enumerate(plan.replicas):
        for shard in replica.shards:
            node = nodes.get(shard.node)
            gpu = node.gpus[0].model if node is not None and node.gpus else "-"
            link = link_name(node, shard.gpus) if node is not None and shard.gpus else "-"
            rows.append(
                [
                    i if shard.pp_rank == 0 else "",
                    shard.node,
                    ",".join(map(str, shard.gpus)) or "cpu",
                    gpu,
                    shard.pp_rank,
                    f"{replica.tp}×{replica.pp}",
                    replica.quantization.value,
                    link,
                    f"{replica.per_gpu_memory_gib:.1f}",
                    replica.max_concurrency,
                ]
            )
    placed = len(plan.replicas)
    title = (
        f"{plan.model} on {source}: {placed} of {placed + plan.unplaced} replica(s) placed "
        f"({spec.strategy.value})"
    )
    if rows:
        ui.table(
            [
                "replica",
                "node",
                "GPUs",
                "GPU",
                "pp rank",
                "tp×pp",
                "quant",
                "TP link",
                "GiB/GPU",
                "max concurrency",
            ],
            rows,
            title=title,
        )
    else:
        ui.out(title)
    for note in plan.notes:
        ui.out(f"note: {note}")
    for reason in plan.reasons:
        ui.out(reason)


def _explain(plan: Plan, fleet: Fleet, spec: DeploymentSpec, model: ModelSpec) -> None:
    """Print the memory arithmetic for each layout the plan uses (or would need, when nothing fits)."""
    from controlplane.catalog import draft_model, estimate, lora_budget

    draft = draft_model(spec)
    types: dict[tuple[str, int], None] = {}
    nodes = {n.name: n for n in fleet.nodes}
    seen: set[tuple[object, ...]] = set()
    layouts: list[tuple[str, int, int, int, Quantization]] = []
    quant: Quantization
    for replica in plan.replicas:
        node = nodes.get(replica.shards[0].node)
        if node is None or not node.gpus:
            continue
        gpu = next(g for g in node.gpus if g.index in replica.shards[0].gpus)
        key = (gpu.model, gpu.memory_total_mib, replica.tp, replica.pp, replica.quantization)
        if key not in seen:
            seen.add(key)
            layouts.append(key)
    if not layouts:
        quant = Quantization.NONE if spec.quantization is Quantization.AUTO else spec.quantization
        for node in fleet.nodes:
            for g in node.gpus:
                types.setdefault((g.model, g.memory_total_mib), None)
        layouts = [(m, mib, spec.tp, spec.pp or 1, quant) for m, mib in types]
    ui.out("")
    ui.out("memory arithmetic (per GPU):")
    for gpu_model, mib, tp, pp, quant in layouts:
        est = estimate(
            model,
            tp=tp,
            pp=pp,
            gpu_memory_mib=mib,
            gpu_model=gpu_model,
            quantization=quant,
            dtype=spec.dtype,
            kv_cache_dtype=spec.kv_cache_dtype,
            max_model_len=spec.max_model_len,
            concurrency=spec.concurrency,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            draft=draft,
            **lora_budget(spec),
        )
        for line in est.explain():
            ui.out(line)


def _models_command(catalog: list[Path] | None, output: PlanOutput) -> None:
    from controlplane.catalog import Catalog, kv_bytes_per_token
    from controlplane.settings import load_settings

    cat = Catalog.load([*load_settings().catalog, *(catalog or [])])
    entries = [cat.entry(name) for name in cat.names()]
    if output is PlanOutput.JSON:
        ui.print_json([e.model_dump(mode="json") for e in entries])
        return
    rows = [
        [
            e.name,
            ", ".join(e.aliases) or "-",
            f"{e.num_params / 1e9:.2f} B" if e.num_params >= 10**8 else f"{e.num_params / 1e6:.2f} M",
            e.num_layers,
            f"{e.num_attention_heads}/{e.num_kv_heads}",
            f"{e.num_experts}×top{e.experts_per_token}" if e.num_experts > 1 else "-",
            f"{kv_bytes_per_token(e):,}",
            e.max_model_len,
            ",".join(q.value for q in e.quantizations),
        ]
        for e in entries
    ]
    ui.table(
        [
            "model",
            "aliases",
            "params (B)",
            "layers",
            "heads/kv",
            "experts",
            "KV B/token",
            "max len",
            "variants",
        ],
        rows,
    )


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``."""

    @app.command("models")
    def models_command(
        *,
        catalog: Annotated[
            list[Path] | None,
            typer.Option("--catalog", help="Extra catalog YAML or local model directory (repeatable)."),
        ] = None,
        output: Annotated[
            PlanOutput, typer.Option("--output", "-o", help="table, or the catalog entries as json.")
        ] = PlanOutput.TABLE,
    ) -> None:
        """List the model catalog: architecture numbers, KV bytes per token (bf16) and weight variants."""
        _models_command(catalog, output)

    @app.command("plan")
    def plan_command(
        model: Annotated[str, typer.Argument(help="Model name or alias from the catalog, e.g. llama-70b.")],
        *,
        tp: Annotated[int, typer.Option("--tp", min=1, max=64, help="Tensor-parallel GPUs per stage.")] = 1,
        pp: Annotated[
            int | None,
            typer.Option("--pp", min=1, max=64, help="Pipeline stages (default: smallest that fits)."),
        ] = None,
        replicas: Annotated[int, typer.Option("--replicas", min=1, max=1024, help="Replicas to place.")] = 1,
        quantization: Annotated[
            Quantization,
            typer.Option("--quantization", help="Weight variant; auto picks the most precise that fits."),
        ] = Quantization.NONE,
        max_model_len: Annotated[
            int | None,
            typer.Option("--max-model-len", min=16, help="Context length (default: the model's)."),
        ] = None,
        concurrency: Annotated[
            int,
            typer.Option(
                "--concurrency", min=1, help="Sequences of max-model-len the KV cache must hold at once."
            ),
        ] = 1,
        strategy: Annotated[
            Strategy, typer.Option("--strategy", help="binpack fills nodes; spread evens them out.")
        ] = Strategy.BINPACK,
        gpu_memory_utilization: Annotated[
            float,
            typer.Option(
                "--gpu-memory-utilization", min=0.06, max=0.99, help="vLLM's share of each GPU's memory."
            ),
        ] = 0.9,
        inventory: Annotated[
            Path | None,
            typer.Option(
                "-i",
                "--inventory",
                parser=optional_path,
                metavar="PATH",
                help="Ansible inventory (INI/YAML) or fleet file. Default: $SARV_INVENTORY, else this host.",
            ),
        ] = None,
        catalog: Annotated[
            list[Path] | None,
            typer.Option("--catalog", help="Extra catalog YAML or local model directory (repeatable)."),
        ] = None,
        output: Annotated[
            PlanOutput, typer.Option("--output", "-o", help="table, or the JSON contract.")
        ] = PlanOutput.TABLE,
        explain: Annotated[
            bool, typer.Option("--explain", help="Print the memory arithmetic and every refused node.")
        ] = False,
        engine: Annotated[
            EngineChoice,
            typer.Option(
                "--engine", help="As for deploy: vllm, vllm-cpu, sim; auto: vllm with GPUs, else vllm-cpu."
            ),
        ] = EngineChoice.AUTO,
        lora_module: Annotated[
            list[str] | None,
            typer.Option(help="As for deploy: LoRA adapter NAME=PATH (its slots count against memory)."),
        ] = None,
        speculative_config: Annotated[
            str | None,
            typer.Option(help='As for deploy: "ngram[:N]", "draft:MODEL[:N]" (the draft counts) or JSON.'),
        ] = None,
    ) -> None:
        """Plan where the replicas of MODEL would run; changes nothing.

        Exit codes: 0 all replicas placed, 3 some could not be placed (reasons printed), 2 bad input.
        """
        from controlplane.catalog import Catalog
        from controlplane.fleet import load_fleet
        from controlplane.launchers import is_local_node
        from controlplane.placement import choose_engine, place, plan_to_json
        from controlplane.settings import load_settings
        from controlplane.spec import DeploymentSpec, EngineKind, LoraAdapter, SpeculativeConfig

        settings = load_settings()
        source = inventory if inventory is not None else settings.inventory
        model_spec = Catalog.load([*settings.catalog, *(catalog or [])]).get(model)
        fleet = load_fleet(source)
        notes: list[str] = []
        if engine is EngineChoice.AUTO:
            kind, why = choose_engine(fleet)
            notes.append(f"engine: {kind.value} ({why})")
        else:
            kind = EngineKind(engine.value)
        spec = DeploymentSpec(
            name=_deployment_name(model_spec.name),
            model=model_spec.name,
            replicas=replicas,
            tp=tp,
            pp=pp,
            quantization=quantization,
            max_model_len=max_model_len,
            concurrency=concurrency,
            strategy=strategy,
            gpu_memory_utilization=gpu_memory_utilization,
            engine=kind,
            lora_adapters=[a for m in lora_module or [] for a in LoraAdapter.parse_list(m)],
            speculative=SpeculativeConfig.parse(speculative_config) if speculative_config else None,
        )
        # The same placement `llmctl deploy` records, with the same answers about this host.
        result = place(
            fleet, spec, model_spec, is_local=is_local_node, local_cpus=os.cpu_count(), explain=explain
        )
        result = result.model_copy(update={"notes": [*notes, *result.notes]})
        if output is PlanOutput.JSON:
            ui.print_json(plan_to_json(result))
        else:
            _print_table(result, fleet, spec, str(source) if source is not None else "this host")
            if explain:
                _explain(result, fleet, spec, model_spec)
        if result.unplaced:
            raise typer.Exit(code=PlacementError.exit_code)
