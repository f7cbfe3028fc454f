"""Recording events (``llmctl events``): one helper for the controller and the commands alike."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from controlplane.errors import SarvError
from controlplane.state.base import EventRecord

if TYPE_CHECKING:
    from controlplane.controller.reconcile import ControllerMetrics
    from controlplane.state.base import StateStore

__all__ = ["EventType", "record_event"]

logger = logging.getLogger(__name__)

EventType = Literal["Normal", "Warning"]


def record_event(
    store: StateStore,
    reason: str,
    message: str,
    *,
    object: str = "",
    deployment: str | None = None,
    type: EventType = "Normal",
    source: str = "llmctl",
    metrics: ControllerMetrics | None = None,
    clock: Callable[[], float] = time.time,
) -> EventRecord:
    """Append one event to ``store`` and return it; ``metrics`` (the controller's) counts it by reason.

    ``object`` defaults to ``deployment/NAME`` when only ``deployment`` is given. An event that cannot be
    written is logged, never raised: the action it reports has happened either way.
    """
    event = EventRecord(
        at=clock(),
        type=type,
        reason=reason,
        message=message,
        object=object or (f"deployment/{deployment}" if deployment else ""),
        deployment=deployment,
        source=source,
    )
    try:
        store.append_event(event)
    except SarvError as exc:
        logger.warning("could not record event %s %s: %s", reason, event.object, exc)
    if metrics is not None:
        metrics.events.labels(reason, type).inc()
    (logger.warning if type == "Warning" else logger.info)("%s %s: %s", reason, event.object, message)
    return event
