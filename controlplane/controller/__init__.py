"""Deploy orchestration (plan → desired → launch → ready → observed), rollback and undeploy."""

from controlplane.controller.deploy import (
    Deployer,
    DeployResult,
    ModelCatalog,
    Observation,
    Planner,
    default_engines,
)

__all__ = ["DeployResult", "Deployer", "ModelCatalog", "Observation", "Planner", "default_engines"]
