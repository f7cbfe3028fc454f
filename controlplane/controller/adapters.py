"""LoRA adapters on a running deployment: add or remove one on every replica, or on none.

An added adapter is verified and copied to each replica's node first (the node's model cache, like the
weights), then loaded through vLLM's runtime endpoints (``POST /v1/load_lora_adapter``), replica by replica;
a failure on one unloads it from those that took it. The deployment's desired state then records it, so a
redeploy or a restarted replica serves it too, and each replica's record lists it, which is what the
gateway routes by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import SecretStr

from controlplane.controller.deploy import Deployer
from controlplane.engines.base import lora_enabled
from controlplane.errors import LaunchError, NotFoundError, SarvError, UserError
from controlplane.spec import DeploymentRecord, LoraAdapter, ReplicaRecord, ReplicaState
from controlplane.weights import WeightsPolicy
from controlplane.weights.adapters import DEFAULT_MAX_LORA_RANK, check_adapter_source

__all__ = ["AdapterManager", "Post"]

Post = Callable[[str, dict[str, object], SecretStr | None], tuple[int, str]]
"""``(url, json body, api key) -> (status, body text)``; ``OSError`` when the replica is unreachable."""


def _http_post(url: str, body: dict[str, object], api_key: SecretStr | None) -> tuple[int, str]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}
    try:
        resp = httpx.post(url, json=body, headers=headers, timeout=120.0)
    except httpx.HTTPError as exc:
        raise OSError(f"{type(exc).__name__}: {exc}") from None
    return resp.status_code, resp.text


def _why(text: str) -> str:
    import json

    try:
        data = json.loads(text)
        message = data.get("error", {}).get("message") or data.get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message or text).strip().splitlines()[0][:300] if (message or text).strip() else "no answer"


@dataclass
class AdapterManager:
    """``llmctl lora add|remove|list``: the deployer provides the store and each replica's launcher."""

    deployer: Deployer
    post: Post = _http_post

    def _record(self, deployment: str) -> DeploymentRecord:
        record = self.deployer.store.get_deployment(deployment)
        if record is None:
            known = ", ".join(d.name for d in self.deployer.store.list_deployments()) or "none"
            raise NotFoundError(f"no deployment named {deployment!r} (deployments: {known})")
        return record

    def _replicas(self, deployment: str) -> list[ReplicaRecord]:
        # Replicas on their way out (draining, stopping) take no adapter and hold nothing up.
        leaving = {ReplicaState.DRAINING, ReplicaState.STOPPING}
        replicas = [r for r in self.deployer.store.list_replicas(deployment) if r.state not in leaving]
        not_ready = [r.id for r in replicas if r.state is not ReplicaState.READY]
        if not_ready or not replicas:
            raise LaunchError(
                f"deployment {deployment} has replicas that are not ready: {', '.join(not_ready) or 'none'}",
                hint="wait for `llmctl status` to show every replica ready, then try again",
            )
        return replicas

    def adapters(self, deployment: str) -> list[LoraAdapter]:
        return list(self._record(deployment).spec.lora_adapters)

    def add(self, deployment: str, name: str, source: str) -> list[str]:
        """Verify, copy and load adapter ``name`` on every replica; returns the replica ids."""
        record = self._record(deployment)
        spec = record.spec
        adapter = LoraAdapter(name=name, source=source)
        if not lora_enabled(spec):
            raise UserError(
                f"deployment {deployment} was started without LoRA",
                hint="redeploy it with --lora-module NAME=PATH or --engine-arg enable_lora=true",
            )
        if name == spec.name or name in {a.name for a in spec.lora_adapters}:
            raise UserError(f"deployment {deployment} already serves a model named {name!r}")
        max_rank = int(spec.engine_args.get("max_lora_rank", DEFAULT_MAX_LORA_RANK))
        check_adapter_source(name, source, max_lora_rank=max_rank)
        replicas = self._replicas(deployment)
        # Copied to every node first: a node that cannot take it stops the add before any replica loads it.
        paths: dict[str, str] = {}
        for rec in replicas:
            launcher = self.deployer._launcher_for_record(rec)
            if launcher is None:
                raise LaunchError(f"replica {rec.id} runs on {rec.node}, out of this host's reach")
            for node in dict.fromkeys(s.node for s in rec.shards) or [rec.node]:
                key = f"{rec.id}:{node}"
                landed = launcher.ensure_weights(source, f"{spec.model}-lora-{name}", policy=WeightsPolicy())
                paths[key] = str(landed)
            paths[rec.id] = paths[f"{rec.id}:{rec.shards[0].node if rec.shards else rec.node}"]
        loaded: list[ReplicaRecord] = []
        try:
            for rec in replicas:
                code, text = self.post(
                    f"{rec.endpoint}/v1/load_lora_adapter",
                    {"lora_name": name, "lora_path": paths[rec.id]},
                    self.deployer.api_key,
                )
                if code != 200:
                    raise LaunchError(f"replica {rec.id} refused adapter {name!r}: HTTP {code}: {_why(text)}")
                loaded.append(rec)
        except (SarvError, OSError) as exc:
            errors = self._unload(loaded, name)
            tail = f"; rollback incomplete: {'; '.join(errors)}" if errors else ""
            message = exc.message if isinstance(exc, SarvError) else f"a replica is unreachable: {exc}"
            raise LaunchError(f"{message}; adapter {name!r} was unloaded from the others{tail}") from None
        record.spec = spec.model_copy(update={"lora_adapters": [*spec.lora_adapters, adapter]})
        record.updated_at = self.deployer.clock()
        self.deployer.store.put_deployment(record)
        for rec in replicas:
            rec.adapters = [*rec.adapters, name]
            self.deployer.store.put_replica(rec)
        return [r.id for r in replicas]

    def remove(self, deployment: str, name: str) -> list[str]:
        """Unload adapter ``name`` from every replica and drop it from the desired state."""
        record = self._record(deployment)
        spec = record.spec
        kept = [a for a in spec.lora_adapters if a.name != name]
        if len(kept) == len(spec.lora_adapters):
            names = ", ".join(a.name for a in spec.lora_adapters) or "none"
            raise NotFoundError(f"deployment {deployment} has no adapter {name!r} (adapters: {names})")
        removed = next(a for a in spec.lora_adapters if a.name == name)
        replicas = self._replicas(deployment)
        unloaded: list[ReplicaRecord] = []
        try:
            for rec in replicas:
                code, text = self.post(
                    f"{rec.endpoint}/v1/unload_lora_adapter", {"lora_name": name}, self.deployer.api_key
                )
                # 404: this replica no longer has it (restarted without it); nothing to undo there.
                if code not in (200, 404):
                    raise LaunchError(f"replica {rec.id} did not unload {name!r}: HTTP {code}: {_why(text)}")
                unloaded.append(rec)
        except (SarvError, OSError) as exc:
            errors = self._reload(unloaded, removed)
            tail = f"; rollback incomplete: {'; '.join(errors)}" if errors else ""
            message = exc.message if isinstance(exc, SarvError) else f"a replica is unreachable: {exc}"
            raise LaunchError(f"{message}; adapter {name!r} was loaded again on the others{tail}") from None
        record.spec = spec.model_copy(update={"lora_adapters": kept})
        record.updated_at = self.deployer.clock()
        self.deployer.store.put_deployment(record)
        for rec in replicas:
            rec.adapters = [a for a in rec.adapters if a != name]
            self.deployer.store.put_replica(rec)
        return [r.id for r in replicas]

    def _unload(self, replicas: list[ReplicaRecord], name: str) -> list[str]:
        errors: list[str] = []
        for rec in replicas:
            try:
                code, text = self.post(
                    f"{rec.endpoint}/v1/unload_lora_adapter", {"lora_name": name}, self.deployer.api_key
                )
                if code not in (200, 404):
                    errors.append(f"{rec.id}: HTTP {code}: {_why(text)}")
            except OSError as exc:
                errors.append(f"{rec.id}: {exc}")
        return errors

    def _reload(self, replicas: list[ReplicaRecord], adapter: LoraAdapter) -> list[str]:
        errors: list[str] = []
        for rec in replicas:
            launcher = self.deployer._launcher_for_record(rec)
            try:
                if launcher is None or adapter.source is None:
                    raise OSError("out of this host's reach")
                model = self.deployer.store.get_deployment(rec.deployment)
                base = model.spec.model if model is not None else rec.model
                path = launcher.ensure_weights(
                    adapter.source, f"{base}-lora-{adapter.name}", policy=WeightsPolicy()
                )
                code, text = self.post(
                    f"{rec.endpoint}/v1/load_lora_adapter",
                    {"lora_name": adapter.name, "lora_path": str(path)},
                    self.deployer.api_key,
                )
                if code != 200:
                    errors.append(f"{rec.id}: HTTP {code}: {_why(text)}")
            except (OSError, SarvError) as exc:
                errors.append(f"{rec.id}: {exc}")
        return errors
