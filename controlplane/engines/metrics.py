"""The one parser of vLLM's load metrics (its ``/metrics`` page), for the gateway and the controller."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VllmLoad", "parse_vllm_metrics"]

# Each measure by its names, newest first: vLLM renamed some across releases and exported both names for
# a while, so the first name present on a page wins and the others are not added to it.
_WAITING = ("vllm:num_requests_waiting",)
_RUNNING = ("vllm:num_requests_running",)
# ≥ 0.10 (V1 engine): kv_cache_usage_perc; earlier releases gpu_cache_usage_perc (same meaning, 0..1).
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# The time requests spend waiting for a slot, as a histogram; time_in_queue_requests is the V0 name.
_QUEUE_SUM = ("vllm:request_queue_time_seconds_sum", "vllm:time_in_queue_requests_sum")
_QUEUE_COUNT = ("vllm:request_queue_time_seconds_count", "vllm:time_in_queue_requests_count")
_READ = frozenset(_WAITING + _RUNNING + _KV + _QUEUE_SUM + _QUEUE_COUNT)


@dataclass(frozen=True)
class VllmLoad:
    """One scrape of a replica's load: gauges summed over its served models (KV usage: the highest)."""

    waiting: float | None = None
    """Requests queued for a slot; None when the page has no such series."""
    running: float | None = None
    """Requests in the running batch."""
    kv_cache_usage: float | None = None
    """Fraction (0..1) of the KV cache in use."""
    queue_time_s_total: float | None = None
    """Seconds finished requests spent queued, since the engine started (a counter)."""
    queued_requests_total: float | None = None
    """Finished requests those seconds are over (a counter): diff two scrapes for a recent mean."""

    @property
    def ongoing(self) -> float | None:
        """Waiting + running requests; None when the page reports neither."""
        if self.waiting is None and self.running is None:
            return None
        return (self.waiting or 0.0) + (self.running or 0.0)


def _sample(line: str) -> tuple[str, float] | None:
    """``name{labels} value [timestamp]`` → (name, value); None for lines that are not such a sample."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name, rest = line[:brace], line[line.rfind("}") + 1 :]
    elif space != -1:
        name, rest = line[:space], line[space:]
    else:
        return None
    parts = rest.split()
    if not parts:
        return None
    try:
        return name, float(parts[0])
    except ValueError:
        return None


def parse_vllm_metrics(text: str) -> VllmLoad | None:
    """The load measures of a vLLM (or simulator) ``/metrics`` page; None when it has none of them.

    Reads only ``vllm:`` samples (comments and every other series are skipped without parsing), so it is
    cheap enough for the gateway's scrape loop.
    """
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        sample = _sample(line)
        if sample is None or sample[0] not in _READ:
            continue
        name, value = sample
        sums[name] = sums.get(name, 0.0) + value
        maxes[name] = max(maxes.get(name, value), value)

    def first(names: tuple[str, ...], found: dict[str, float]) -> float | None:
        return next((found[n] for n in names if n in found), None)

    load = VllmLoad(
        waiting=first(_WAITING, sums),
        running=first(_RUNNING, sums),
        kv_cache_usage=first(_KV, maxes),
        queue_time_s_total=first(_QUEUE_SUM, sums),
        queued_requests_total=first(_QUEUE_COUNT, sums),
    )
    if load.waiting is None and load.running is None and load.kv_cache_usage is None:
        return None
    return load
