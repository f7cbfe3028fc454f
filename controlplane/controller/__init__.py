"""Deploy orchestration (plan → desired → launch → ready → observed), rollback and undeploy."""

from controlplane.controller.cpu_plan import cpu_plan
from controlplane.controller.deploy import (
    Deployer,
    DeployResult,
    ModelCatalog,
    Observation,
    Planner,
    default_engines,
)

__all__ = [
    "DeployResult",
    "Deployer",
    "ModelCatalog",
    "Observation",
    "Planner",
    "cpu_plan",
    "default_engines",
]
