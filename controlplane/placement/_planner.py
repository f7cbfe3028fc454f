"""The placement planner: per replica, layouts (pp; one node or across) → filters → candidates → scores."""

from __future__ import annotations

import itertools
import random
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from controlplane.catalog import MemoryEstimate, draft_model, estimate, lora_budget
from controlplane.catalog.compat import CompatTable, Generation, load_compat
from controlplane.errors import UserError
from controlplane.placement._index import LINK_NAMES, NVLINK, FleetIndex, GpuType, Slot
from controlplane.placement._pipeline import (
    Candidate,
    PlacementContext,
    Scorer,
    SlotFilter,
    default_filters,
    default_scorers,
    gib,
)
from controlplane.spec import (
    DeploymentSpec,
    Dtype,
    Fleet,
    ModelSpec,
    Plan,
    Quantization,
    ReplicaPlan,
    Shard,
    Strategy,
)

__all__ = [
    "ATTEMPTS",
    "PlacementRequest",
    "Planner",
    "check_request",
    "plan",
    "plan_many",
    "plan_to_json",
]

WINDOW = 8
"""Nodes per GPU type that are scored for each replica, taken in strategy order (fullest first for
binpack). Scoring every node would make a 1,000-node plan quadratic; the strategy order already puts
the best packing choices first and the window leaves room for topology and anti-affinity to decide."""

MAX_REASON_LINES = 25
"""Per-node refusal lines kept in a plan; the rest are counted."""


class PlacementRequest(BaseModel):
    """One deployment to place with :func:`plan_many`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: DeploymentSpec
    model: ModelSpec
    avoid_nodes: list[str] = Field(default_factory=list)
    """Nodes that already run replicas of this deployment (soft anti-affinity)."""


@dataclass(frozen=True, slots=True)
class _Job:
    """One deployment at one quantization: what every memory question of the planner is about."""

    spec: DeploymentSpec
    model: ModelSpec
    length: int
    quant: Quantization
    key: tuple[object, ...]
    """Everything the memory estimate depends on, so equal deployments share cached estimates."""
    draft: ModelSpec | None = None


def _job(spec: DeploymentSpec, model: ModelSpec, length: int, quant: Quantization) -> _Job:
    mnbt = spec.engine_args.get("max_num_batched_tokens")
    tokens = mnbt if isinstance(mnbt, int) and not isinstance(mnbt, bool) else None
    draft = draft_model(spec)
    key = (
        model.name, model.num_params, model.num_layers, spec.tp, quant, length, spec.concurrency,
        spec.gpu_memory_utilization, spec.dtype, spec.kv_cache_dtype,
        tuple(sorted(lora_budget(spec).items())), draft and draft.model_dump_json(), tokens,
    )  # fmt: skip
    return _Job(spec, model, length, quant, key, draft)


@dataclass(slots=True)
class _Attempt:
    quantization: Quantization
    replicas: list[ReplicaPlan] = field(default_factory=list)
    unplaced: int = 0
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check_request(spec: DeploymentSpec, model: ModelSpec) -> int:
    """Refuse input that can never work (exit 2) and return the max_model_len to plan for."""
    heads, kv = model.num_attention_heads, model.num_kv_heads
    tp = spec.tp
    if heads % tp:
        valid = [d for d in range(1, min(heads, 64) + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        raise UserError(f"tp={tp} does not divide {model.name}'s {heads} attention heads; use tp in {valid}")
    if kv % tp and tp % kv:
        raise UserError(
            f"tp={tp} and {model.name}'s {kv} KV heads do not divide one another (vLLM needs one to divide "
            f"the other); use a tp that divides {kv} or a multiple of it"
        )
    if spec.pp is not None and spec.pp > model.num_layers:
        raise UserError(
            f"pp={spec.pp} exceeds {model.name}'s {model.num_layers} layers; use pp ≤ {model.num_layers}"
        )
    length = spec.max_model_len or model.max_model_len
    if length > model.max_model_len:
        raise UserError(
            f"max_model_len {length} exceeds {model.name}'s context of {model.max_model_len} tokens; "
            f"use --max-model-len ≤ {model.max_model_len}"
        )
    if spec.quantization is not Quantization.AUTO and spec.quantization not in model.quantizations:
        have = ", ".join(q.value for q in model.quantizations)
        raise UserError(
            f"{model.name} has no {spec.quantization.value} variant in the catalog; "
            f"use one of: {have} or auto"
        )
    return length


class Planner:
    """Places deployments one after another on one view of the fleet (what one places, the next sees).

    Pure: it reads the fleet and the already placed shards it is given and returns plans; it never
    does I/O. ``filters`` and ``scorers`` replace the built-in pipeline stages.
    """

    def __init__(
        self,
        fleet: Fleet,
        placed: Sequence[Shard] = (),
        *,
        utilization: float = 0.9,
        filters: Sequence[SlotFilter] | None = None,
        scorers: Sequence[Scorer] | None = None,
        window: int = WINDOW,
        compat: CompatTable | None = None,
    ) -> None:
        self.fleet = fleet
        self.compat = compat if compat is not None else load_compat()
        self._rows: dict[GpuType, Generation | str] = {}
        self._why_not: dict[tuple[GpuType, Quantization, str], str] = {}
        self.index = FleetIndex(fleet, placed, utilization=utilization)
        self.filters = list(filters) if filters is not None else default_filters()
        self._scorers = list(scorers) if scorers is not None else None
        self.window = window
        self._estimates: dict[tuple[object, ...], MemoryEstimate] = {}
        self._fit_cache: dict[tuple[object, ...], bool] = {}
        self._pp_mins: dict[tuple[object, ...], int | None] = {}
        self._largest_node = max((s.size for s in self.index.slots), default=0)

    # --- public

    def plan(
        self,
        spec: DeploymentSpec,
        model: ModelSpec,
        *,
        avoid_nodes: Collection[str] = (),
        explain: bool = False,
        max_gpus: int | None = None,
    ) -> Plan:
        """Place every replica of ``spec``; what is placed stays taken for later calls on this planner.

        ``max_gpus`` skips layouts that need more GPUs per replica (not with ``quantization auto``):
        :func:`plan_many` first places every replica at its cheapest GPU count only.
        """
        length = check_request(spec, model)
        if spec.quantization is Quantization.AUTO:
            attempt = self._plan_auto(spec, model, length, avoid_nodes)
        else:
            job = _job(spec, model, length, spec.quantization)
            attempt = self._place_all(job, avoid_nodes, max_gpus=max_gpus)
        notes = attempt.notes
        if explain and not attempt.unplaced:  # when unplaced, the reasons already go node by node
            job = _job(spec, model, length, attempt.quantization)
            notes = [*notes, *(f"not chosen: {line}" for line in self._node_reasons(job)[:MAX_REASON_LINES])]
        return Plan(
            model=model.name,
            deployment=spec.name,
            replicas=attempt.replicas,
            unplaced=attempt.unplaced,
            reasons=attempt.reasons,
            notes=notes,
        )

    def gpu_counts(self, spec: DeploymentSpec, model: ModelSpec) -> dict[GpuType, int]:
        """GPUs one replica needs on each GPU type that can hold it (its first variant that fits any)."""
        length = spec.max_model_len or model.max_model_len
        quants = model.quantizations if spec.quantization is Quantization.AUTO else [spec.quantization]
        for quant in quants:
            job = _job(spec, model, length, quant)
            counts: dict[GpuType, int] = {}
            for gpu_type in self.index.gpu_types():
                if self._incompatible(job, gpu_type):
                    continue
                pp = spec.pp or self._pp_min(job, gpu_type)
                if pp and self._fits(job, gpu_type, pp):
                    counts[gpu_type] = spec.tp * pp
            if counts:
                return counts
        return {}

    def order_key(self, spec: DeploymentSpec, model: ModelSpec) -> tuple[int, tuple[float, ...], int]:
        """Sort key for placing many deployments: highest regret first, then largest first.

        Regret is how many more GPUs a replica needs on its other GPU types than on its best one,
        compared second-best first (a replica that fits one type only has no alternative at all).
        Placing those first keeps the GPU types they are cheap on for them; among equals,
        first-fit decreasing (most GPUs first) packs best.
        """
        counts = sorted(self.gpu_counts(spec, model).values())
        if not counts:
            return (1, (), 0)  # cannot be placed anywhere: last, its reasons come out the same
        if len(counts) == 1:
            return (0, (-float(1 << 20),), -counts[0])
        return (0, tuple(float(counts[0] - c) for c in counts[1:]), -counts[0])

    # --- quantization

    def _plan_auto(
        self, spec: DeploymentSpec, model: ModelSpec, length: int, avoid: Collection[str]
    ) -> _Attempt:
        # Try variants highest precision first on the live index and roll back all but the winner.
        tried: list[_Attempt] = []
        for quant in model.quantizations:
            mark = self.index.mark()
            attempt = self._place_all(_job(spec, model, length, quant), avoid)
            if attempt.unplaced == 0:
                why = ""
                if tried:
                    first = tried[0]
                    why = f"; {first.quantization.value} placed only {len(first.replicas)} of {spec.replicas}"
                    if len(first.reasons) > 1:
                        why += f" ({first.reasons[1]})"
                attempt.notes.insert(
                    0,
                    f"quantization auto: chose {quant.value}, the highest-precision variant that places all "
                    f"{spec.replicas} replica(s){why}",
                )
                return attempt
            tried.append(attempt)
            self.index.rollback(mark)
        # Nothing places everything: keep the variant that places the most (highest precision on ties).
        best = max(tried, key=lambda a: len(a.replicas))
        attempt = self._place_all(_job(spec, model, length, best.quantization), avoid)
        attempt.notes.insert(
            0,
            f"quantization auto: no variant places all {spec.replicas} replica(s); {best.quantization.value} "
            f"places the most ({len(attempt.replicas)})",
        )
        return attempt

    # --- replicas

    def _place_all(self, job: _Job, avoid: Collection[str], *, max_gpus: int | None = None) -> _Attempt:
        spec = job.spec
        attempt = _Attempt(quantization=job.quant)
        used: set[str] = set(avoid)
        layouts_noted: set[tuple[int, bool]] = set()
        rows_noted: set[str] = set()
        for i in range(spec.replicas):
            found = self._place_one(job, used, max_gpus=max_gpus)
            if found is None:
                attempt.unplaced = spec.replicas - i
                attempt.reasons = self._why(job, attempt.unplaced)
                break
            cand, across = found
            for slot, gpus in cand.stages:
                self.index.take(slot, gpus)
                used.add(slot.name)
            est = cand.estimate
            row = self._row(cand.stages[0][0].gpu_type)
            gen = row if isinstance(row, Generation) else None
            attempt.replicas.append(
                ReplicaPlan(
                    tp=est.tp,
                    pp=est.pp,
                    quantization=job.quant,
                    dtype=gen.dtype_for(spec.dtype) if gen is not None else spec.dtype,
                    kv_cache_dtype=spec.kv_cache_dtype,
                    generation=gen.name if gen is not None else None,
                    shards=[
                        Shard(node=slot.name, gpus=list(gpus), pp_rank=rank)
                        for rank, (slot, gpus) in enumerate(cand.stages)
                    ],
                    per_gpu_memory_gib=round(est.required_mib / 1024, 2),
                    max_concurrency=est.max_concurrency,
                )
            )
            if (est.pp, across) not in layouts_noted:
                layouts_noted.add((est.pp, across))
                attempt.notes.append(self._layout_note(job, cand, across=across, replica=i))
            if gen is not None and gen.name not in rows_noted:
                rows_noted.add(gen.name)
                attempt.notes.append(self._row_note(job, cand.stages[0][0].gpu_type, gen))
        return attempt

    # --- the GPU-generation table

    def _row(self, t: GpuType) -> Generation | str:
        """The table row of GPU type ``t`` (looked up once per type), or why there is none."""
        hit = self._rows.get(t)
        if hit is None:
            gpu = next(
                g for s in self.index.slots if s.gpu_type == t for g in s.node.gpus if g.model == t.model
            )
            try:
                hit = self.compat.generation_for(gpu)
            except UserError as exc:
                hit = str(exc)
            self._rows[t] = hit
        return hit

    def _incompatible(self, job: _Job, t: GpuType) -> str:
        """Why GPUs of type ``t`` cannot run ``job``'s variant and KV-cache dtype (empty when they can)."""
        key = (t, job.quant, job.spec.kv_cache_dtype)
        hit = self._why_not.get(key)
        if hit is None:
            row = self._row(t)
            if isinstance(row, str):
                hit = row
            elif not row.supports(job.quant):
                hit = f"{row.why_not(job.quant)} (GPU table row {row.name})"
            elif job.spec.kv_cache_dtype not in row.kv_cache_dtypes:
                have = ", ".join(row.kv_cache_dtypes)
                hit = (
                    f"{row.name} GPUs have no {job.spec.kv_cache_dtype} KV cache (--kv-cache-dtype: {have}; "
                    f"GPU table row {row.name})"
                )
            else:
                hit = ""
            self._why_not[key] = hit
        return hit

    def _row_note(self, job: _Job, t: GpuType, row: Generation) -> str:
        dtype = row.dtype_for(job.spec.dtype)
        line = (
            f"GPU table: {t.model} is row {row.name} (compute capability {row.compute_capability.min}-"
            f"{row.compute_capability.max}): {job.quant.value} weights, dtype {dtype.value}, "
            f"KV cache {job.spec.kv_cache_dtype}, image tag {row.image.tag} (CUDA {row.image.cuda}, driver "
            f"{row.image.driver_branch}+)"
        )
        if dtype is not job.spec.dtype and job.spec.dtype is not Dtype.AUTO:
            line += f"; {job.spec.dtype.value} becomes {dtype.value}: {row.name} GPUs do not compute in it"
        return line

    def _layouts(self, job: _Job) -> Iterator[tuple[int, bool]]:
        """(pp, across nodes) to try, in order: the user's pp, else one node at the smallest pp that
        fits and only then across nodes (vLLM's layout: tp GPUs on each of pp nodes), because crossing
        nodes costs ~20x per all-reduce."""
        spec, layers, tp = job.spec, job.model.num_layers, job.spec.tp
        if spec.pp is not None:
            yield spec.pp, False
            if spec.pp > 1:
                yield spec.pp, True
            return
        for pp in range(1, min(layers, self._largest_node // tp) + 1):
            yield pp, False
        most_nodes = max((self.index.count_with_free(t, tp) for t in self.index.gpu_types()), default=0)
        for pp in range(2, min(layers, most_nodes) + 1):
            yield pp, True

    def _place_one(
        self, job: _Job, used: set[str], *, max_gpus: int | None = None
    ) -> tuple[Candidate, bool] | None:
        tp = job.spec.tp
        if tp > self._largest_node:
            return None
        types = self.index.gpu_types()
        for pp, across_nodes in self._layouts(job):
            if max_gpus is not None and tp * pp > max_gpus:
                continue
            fitting: dict[GpuType, MemoryEstimate] = {}
            for t in types:
                if self._incompatible(job, t) or not self._could_fit(job, t, pp):
                    continue
                if across_nodes:
                    if self.index.count_with_free(t, tp) < pp:
                        continue
                elif self.index.largest_free(t) < tp * pp:
                    continue
                fitting[t] = self._estimate(job, t, pp)
            if not fitting:
                continue
            ctx = PlacementContext(job.spec, job.model, tp, pp, across_nodes, fitting, used)
            best = self._best_candidate(ctx)
            if best is not None:
                return best, across_nodes
        return None

    def _could_fit(self, job: _Job, t: GpuType, pp: int) -> bool:
        pp_min = self._pp_min(job, t)
        if pp_min is None:
            return False
        if job.spec.pp is None:
            # Auto pp: a type that fits at a smaller pp had no room for it, so it has none for this
            # (larger) layout either; using it here would only spend more of its GPUs.
            return pp == pp_min
        return pp >= pp_min and self._fits(job, t, pp)

    def _best_candidate(self, ctx: PlacementContext) -> Candidate | None:
        scorers = self._scorers if self._scorers is not None else default_scorers(ctx.spec.strategy)
        total_weight = sum(s.weight for s in scorers) or 1.0
        # GPU types in order of tightest fit: the smallest per-GPU budget that holds this layout
        # first, so larger GPUs stay free for the models that need fewer of them there (a 70B at
        # tp=4 fits 40 GB GPUs; taking 80 GB ones would push a later tp=2 70B onto 6 GPUs).
        for gpu_type in sorted(ctx.estimates, key=lambda t: (t.memory_mib, t.model)):
            best: Candidate | None = None
            best_score = -1.0
            for cand in self._candidates(ctx, gpu_type):
                score = sum(s.weight * s.score(cand, ctx) for s in scorers) / total_weight
                # Strictly better only: on a tie the earlier candidate (strategy order, then node
                # name) stays, which keeps plans deterministic.
                if score > best_score + 1e-12:
                    best, best_score = cand, score
            if best is not None:
                return best
        return None

    def _window(self, ctx: PlacementContext, gpu_type: GpuType) -> list[Slot]:
        """Up to ``window`` surviving slots not hosting this deployment, plus a few that do."""
        # A pipeline across nodes needs pp of them, even when pp exceeds the window.
        want = max(self.window, ctx.pp) if ctx.across_nodes else self.window
        preferred: list[Slot] = []
        others: list[Slot] = []
        stream = self.index.stream(
            gpu_type, ctx.gpus_per_node, fullest_first=ctx.spec.strategy is Strategy.BINPACK
        )
        while True:
            chunk = list(itertools.islice(stream, want))
            survivors = chunk
            for flt in self.filters:
                survivors, _ = flt(survivors, ctx)
            for slot in survivors:
                if slot.name not in ctx.avoid:
                    preferred.append(slot)
                elif len(others) < want:
                    others.append(slot)
            if len(chunk) < want or len(preferred) >= want:
                return preferred[:want] + others

    def _candidates(self, ctx: PlacementContext, gpu_type: GpuType) -> list[Candidate]:
        est = ctx.estimates[gpu_type]
        window = self._window(ctx, gpu_type)
        if ctx.across_nodes:
            if len(window) < ctx.pp:
                return []
            stages: list[tuple[Slot, tuple[int, ...]]] = []
            level = NVLINK
            for slot in window[: ctx.pp]:
                group = self.index.best_group(slot, slot.free_mask, ctx.tp)
                if group is None:
                    return []
                stages.append((slot, group[0]))
                level = min(level, group[1])
            return [Candidate(tuple(stages), est, level)]
        out: list[Candidate] = []
        # With the built-in scorers, slots wired alike, with the same free GPUs and the same
        # anti-affinity standing, score the same; the first in strategy order wins ties anyway, so the
        # rest need not be built. Custom scorers may tell them apart (by name, labels …): keep them all.
        prune = self._scorers is None
        seen: set[tuple[int, int, bool]] = set()
        for slot in window:
            twin = (slot.topology, slot.free_mask, slot.name in ctx.avoid)
            if prune and twin in seen:
                continue
            seen.add(twin)
            mask = slot.free_mask
            stages = []
            level = NVLINK
            for _ in range(ctx.pp):
                group = self.index.best_group(slot, mask, ctx.tp)
                if group is None:
                    break
                stages.append((slot, group[0]))
                level = min(level, group[1])
                for i in group[0]:
                    mask &= ~(1 << i)
            if len(stages) == ctx.pp:
                out.append(Candidate(tuple(stages), est, level))
        return out

    # --- memory

    def _estimate(self, job: _Job, t: GpuType, pp: int) -> MemoryEstimate:
        key = (job.key, t, pp)
        hit = self._estimates.get(key)
        if hit is None:
            spec = job.spec
            hit = estimate(
                job.model,
                tp=spec.tp,
                pp=pp,
                gpu_memory_mib=t.memory_mib,
                gpu_model=t.model,
                quantization=job.quant,
                dtype=spec.dtype,
                kv_cache_dtype=spec.kv_cache_dtype,
                max_model_len=job.length,
                concurrency=spec.concurrency,
                gpu_memory_utilization=spec.gpu_memory_utilization,
                max_num_batched_tokens=job.key[-1],  # type: ignore[arg-type]
                draft=job.draft,
                **lora_budget(spec),
            )
            self._estimates[key] = hit
            self._fit_cache[key] = hit.fits
        return hit

    def _fits(self, job: _Job, t: GpuType, pp: int) -> bool:
        key = (job.key, t, pp)
        hit = self._fit_cache.get(key)
        if hit is None:
            hit = self._estimate(job, t, pp).fits
        return hit

    def _pp_min(self, job: _Job, t: GpuType) -> int | None:
        """Smallest pipeline depth at which one GPU of type ``t`` holds its share (None: none does)."""
        key = (job.key, t)
        if key not in self._pp_mins:
            self._pp_mins[key] = next(
                (pp for pp in range(1, job.model.num_layers + 1) if self._fits(job, t, pp)), None
            )
        return self._pp_mins[key]

    # --- explanations

    def _layout_note(self, job: _Job, cand: Candidate, *, across: bool, replica: int) -> str:
        est = cand.estimate
        nodes = ", ".join(dict.fromkeys(slot.name for slot, _ in cand.stages))
        where = "across nodes " + nodes if across else "in one node " + nodes
        line = (
            f"replica {replica}: tp={est.tp} pp={est.pp} {where} on {est.gpu_model}, "
            f"{gib(est.required_mib)} per GPU, TP link {LINK_NAMES[cand.level]}"
        )
        if job.spec.pp is None and est.pp > 1:
            smaller = [self._estimate(job, t, est.pp - 1) for t in self.index.gpu_types()]
            if not any(e.fits for e in smaller):
                top = max(smaller, key=lambda e: e.budget_mib)
                line += (
                    f"; pp={est.pp - 1} would need {gib(top.required_mib)} per GPU, more than the "
                    f"{gib(top.budget_mib)} usable on {top.gpu_model}"
                )
            else:
                line += f"; pp={est.pp - 1} fits in memory but no node had the free GPUs for it"
        return line

    def _reason_layout(self, job: _Job, t: GpuType) -> tuple[int, bool]:
        """The layout to explain for GPU type ``t``: the user's pp, else the smallest pp that fits."""
        if job.spec.pp is not None:
            return job.spec.pp, False
        pp = self._pp_min(job, t)
        if pp is None:
            return job.model.num_layers, False
        largest = max((s.size for s in self.index.slots if s.gpu_type == t), default=0)
        return pp, job.spec.tp * pp > largest

    def _node_reasons(self, job: _Job) -> list[str]:
        """Why each node cannot take (another) replica, by node name; then the across-node summaries."""
        spec, tp = job.spec, job.spec.tp
        per_node: list[tuple[str, str]] = []
        summaries: list[str] = []
        for t in self.index.gpu_types():
            why_not = self._incompatible(job, t)
            if why_not:
                slots_t = [s for s in self.index.slots if s.gpu_type == t]
                selector = next((f for f in self.filters if f.name == "selector"), None)
                if selector is not None:
                    ctx0 = PlacementContext(spec, job.model, tp, 1, False, {}, set())
                    slots_t, why = selector(slots_t, ctx0)
                    per_node.extend((line.split(":", 1)[0], line) for line in why)
                per_node.extend((s.name, f"{s.name}: {t}: {why_not}") for s in slots_t)
                continue
            pp, across = self._reason_layout(job, t)
            est = self._estimate(job, t, pp)
            ctx = PlacementContext(spec, job.model, tp, pp, across, {t: est}, set())
            slots: list[Slot] = [s for s in self.index.slots if s.gpu_type == t]
            for flt in self.filters:
                slots, why = flt(slots, ctx)
                per_node.extend((line.split(":", 1)[0], line) for line in why)
            if (across or pp > 1) and est.fits:
                have = self.index.count_with_free(t, tp)
                summaries.append(
                    f"across nodes: {have} {t} node(s) have {tp} free GPUs; tp={tp} pp={pp} needs "
                    f"{pp} such nodes with {gib(est.required_mib)} per GPU"
                )
        lines = [line for _, line in sorted(per_node, key=lambda p: p[0])] + summaries
        if not self.index.slots:
            lines.insert(
                0,
                f"no node has GPUs: engine {spec.engine.value} needs them "
                "(engines sim and vllm-cpu run on CPU hosts)",
            )
        elif tp > self._largest_node:
            lines.insert(
                0,
                f"tp={tp}: a TP group stays inside one node and the largest node has "
                f"{self._largest_node} GPUs",
            )
        gpu_nodes = {s.name for s in self.index.slots}
        no_gpu = sorted(n.name for n in self.fleet.nodes if n.name not in gpu_nodes)
        if no_gpu:
            lines.append(f"{', '.join(no_gpu)}: no GPUs")
        return lines

    def _why(self, job: _Job, unplaced: int) -> list[str]:
        spec = job.spec
        pp = f" pp={spec.pp}" if spec.pp is not None else ""
        head = (
            f"{unplaced} of {spec.replicas} replica(s) of {job.model.name} (tp={spec.tp}{pp}, "
            f"quantization {job.quant.value}, max_model_len {job.length}, concurrency {spec.concurrency}) "
            "could not be placed:"
        )
        if not self.fleet.nodes:
            return [head, "the fleet has no nodes; give an inventory with -i"]
        lines = self._node_reasons(job)
        if len(lines) > MAX_REASON_LINES:
            more = len(lines) - MAX_REASON_LINES
            lines = [*lines[:MAX_REASON_LINES], f"… and {more} more line(s) of the same kinds"]
        return [head, *lines]


# --- module API


def plan(
    fleet: Fleet,
    spec: DeploymentSpec,
    model: ModelSpec,
    placed: Sequence[Shard] = (),
    *,
    avoid_nodes: Collection[str] = (),
    explain: bool = False,
) -> Plan:
    """GPU placement of ``spec``'s replicas of ``model`` on ``fleet``, around the GPUs ``placed`` shards hold,
    whatever ``spec.engine`` says (:func:`~controlplane.placement.place` decides which placement an engine
    gets). ``avoid_nodes`` are nodes that already run replicas of this deployment. ``explain`` adds each
    refused node's reason to ``notes``.
    """
    planner = Planner(fleet, placed, utilization=spec.gpu_memory_utilization)
    return planner.plan(spec, model, avoid_nodes=avoid_nodes, explain=explain)


ATTEMPTS = 16
"""Orders :func:`plan_many` tries at most; it stops at the first that places every replica at its
cheapest GPU count (the first one, on a fleet with room)."""


def plan_many(
    fleet: Fleet,
    requests: Sequence[PlacementRequest],
    placed: Sequence[Shard] = (),
    *,
    attempts: int = ATTEMPTS,
) -> list[Plan]:
    """Place many deployments on one fleet; plans come back in request order.

    Requests are placed in :meth:`Planner.order_key` order (highest regret, then largest first), which
    packs a mixed fleet far better than arrival order. When that leaves replicas unplaced or spends more
    GPUs than each replica's cheapest layout, up to ``attempts - 1`` perturbed orders (seeded, so the
    answer is still deterministic) are tried and the best kept: most replicas placed, then fewest
    GPUs. GPU plans only.
    """
    for req in requests:
        check_request(req.spec, req.model)
    utilization = max((r.spec.gpu_memory_utilization for r in requests), default=0.9)
    best: list[Plan] = []
    best_key: tuple[int, int] | None = None
    for attempt in range(max(1, attempts)):
        planner = Planner(fleet, placed, utilization=utilization)
        counts = [planner.gpu_counts(r.spec, r.model) for r in requests]
        keys = [planner.order_key(r.spec, r.model) for r in requests]
        if attempt:
            # Perturb the regret part of the key by less than two GPUs, seeded by the attempt number.
            rng = random.Random(attempt)  # noqa: S311 - seeded ordering noise, not security
            keys = [(k[0], tuple(x + 1.5 * rng.random() for x in k[1]), k[2]) for k in keys]
        order = sorted(range(len(requests)), key=lambda i: (*keys[i], i))
        plans = _place_batch(planner, requests, order, counts)
        n_placed = sum(len(p.replicas) for p in plans)
        used = sum(len(s.gpus) for p in plans for r in p.replicas for s in r.shards)
        key = (n_placed, -used)
        if best_key is None or key > best_key:
            best, best_key = plans, key
        cheapest = sum(min(c.values()) * r.spec.replicas for c, r in zip(counts, requests, strict=True) if c)
        if n_placed == sum(r.spec.replicas for r in requests) and used <= cheapest:
            break
    return best


def _place_batch(
    planner: Planner,
    requests: Sequence[PlacementRequest],
    order: Sequence[int],
    counts: Sequence[dict[GpuType, int]],
) -> list[Plan]:
    # Two passes. First every replica at its cheapest GPU count only, so a replica that would need
    # three times its GPUs on a leftover type cannot starve many cheaper ones; then what is left,
    # with every layout allowed. Quantization auto chooses its own variant and is placed in pass 2.
    plans: dict[int, Plan] = {}
    for i in order:
        req = requests[i]
        if req.spec.quantization is Quantization.AUTO or not counts[i]:
            continue
        plans[i] = planner.plan(
            req.spec, req.model, avoid_nodes=req.avoid_nodes, max_gpus=min(counts[i].values())
        )
    for i in order:
        req = requests[i]
        first = plans.get(i)
        if first is not None and not first.unplaced:
            continue
        if first is None:
            plans[i] = planner.plan(req.spec, req.model, avoid_nodes=req.avoid_nodes)
            continue
        rest = req.spec.model_copy(update={"replicas": first.unplaced})
        used = {s.node for r in first.replicas for s in r.shards}
        second = planner.plan(rest, req.model, avoid_nodes=[*req.avoid_nodes, *sorted(used)])
        plans[i] = first.model_copy(
            update={
                "replicas": [*first.replicas, *second.replicas],
                "unplaced": second.unplaced,
                "reasons": second.reasons,
                "notes": [*first.notes, *second.notes],
            }
        )
    return [plans[i] for i in range(len(requests))]


def plan_to_json(plan: Plan) -> dict[str, object]:
    """The stable JSON contract of ``llmctl plan --output json`` (only these keys, in this order)."""
    return {
        "model": plan.model,
        "replicas": [
            {
                "tp": r.tp,
                "pp": r.pp,
                "shards": [{"node": s.node, "gpus": list(s.gpus), "pp_rank": s.pp_rank} for s in r.shards],
                "per_gpu_memory_gib": r.per_gpu_memory_gib,
                "max_concurrency": r.max_concurrency,
            }
            for r in plan.replicas
        ],
        "unplaced": plan.unplaced,
        "reasons": list(plan.reasons),
    }
