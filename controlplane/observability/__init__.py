"""Observability: Prometheus file_sd target files written from the replicas the control plane runs."""

from controlplane.observability.targets import (
    SCRAPED_STATES,
    TargetGroup,
    replica_target_groups,
    write_file_sd,
    write_replica_targets,
)

__all__ = [
    "SCRAPED_STATES",
    "TargetGroup",
    "replica_target_groups",
    "write_file_sd",
    "write_replica_targets",
]
