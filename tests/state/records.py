"""Sample records and the ACL credentials shared by the state tests."""

from __future__ import annotations

from controlplane.spec import DeploymentRecord, DeploymentSpec, EngineKind, Plan, ReplicaRecord, ReplicaState
from controlplane.state import ApiKeyRecord

ACL_USER = "sarv-state"
ACL_PASSWORD = "acl-Pa55-" + "x" * 12


def deployment(name: str, replicas: int = 1) -> DeploymentRecord:
    return DeploymentRecord(
        spec=DeploymentSpec(name=name, model="llama-3-8b", replicas=replicas, engine=EngineKind.SIM),
        plan=Plan(model="llama-3-8b", deployment=name, reasons=["fits"]),
        created_at=1.0,
        updated_at=2.0,
    )


def replica(deployment: str, index: int, state: ReplicaState = ReplicaState.READY) -> ReplicaRecord:
    return ReplicaRecord(
        id=f"{deployment}-{index}",
        deployment=deployment,
        index=index,
        model=deployment,
        engine=EngineKind.SIM,
        node="local",
        endpoint=f"http://127.0.0.1:{8100 + index}",
        state=state,
        adapters=["a1"],
        handle={"pid": "123"},
    )


def api_key(name: str, digit: str) -> ApiKeyRecord:
    return ApiKeyRecord(name=name, key_hash=digit * 64, prefix="sk-sarv-ab", models=["m"], rpm=10)
