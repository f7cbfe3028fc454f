"""The one parser of vLLM's load metrics (its ``/metrics`` page), for the gateway and the controller."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "QUEUE_TIME",
    "TTFT",
    "HistogramSample",
    "VllmLoad",
    "parse_counters",
    "parse_histogram",
    "parse_vllm_metrics",
]

# Each measure by its names, newest first: vLLM renamed some across releases and exported both names for
# a while, so the first name present on a page wins and the others are not added to it.
_WAITING = ("vllm:num_requests_waiting",)
_RUNNING = ("vllm:num_requests_running",)
# ≥ 0.10 (V1 engine): kv_cache_usage_perc; earlier releases gpu_cache_usage_perc (same meaning, 0..1).
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# The time requests spend waiting for a slot, as a histogram; time_in_queue_requests is the V0 name.
_QUEUE_SUM = ("vllm:request_queue_time_seconds_sum", "vllm:time_in_queue_requests_sum")
_QUEUE_COUNT = ("vllm:request_queue_time_seconds_count", "vllm:time_in_queue_requests_count")
QUEUE_TIME = "vllm:request_queue_time_seconds"
"""The histogram of the seconds each request waited for a slot (vLLM V1)."""
TTFT = "vllm:time_to_first_token_seconds"
"""The histogram of the seconds from a request's arrival to its first token."""
_READ = frozenset(_WAITING + _RUNNING + _KV + _QUEUE_SUM + _QUEUE_COUNT)
# A sample of one of them on a line of its own: ``name{labels} value [timestamp]`` (labels optional; a label
# value may hold "}", so the labels end at the line's last one, as in _sample). Matched after a newline
# rather than with ^ and re.MULTILINE: a pattern that starts with a literal is searched for as a string,
# ten times faster on a page of ~250 vllm: lines.
_LOAD_SAMPLE = re.compile(
    r"\n(" + "|".join(re.escape(n) for n in sorted(_READ)) + r")(?:\{[^\n]*\})?[ \t]+([^ \t\n]+)"
)


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

    One regular expression finds just the samples of the measures read (a page has ~250 ``vllm:`` lines,
    mostly histogram buckets, and only a handful are needed): ~25 µs a page instead of ~260 µs line by
    line, which the gateway's scrape loop pays several times a second per replica.
    """
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    for match in _LOAD_SAMPLE.finditer("\n" + text):
        name = match[1]
        try:
            value = float(match[2])
        except ValueError:
            continue
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


@dataclass(frozen=True)
class HistogramSample:
    """One scrape of a Prometheus histogram, summed over its series: cumulative counts per upper bound."""

    bounds: tuple[float, ...]
    """Upper bounds in increasing order, the last one ``+Inf``."""
    cumulative: tuple[float, ...]
    """Observations at or below each bound (cumulative, like the ``_bucket`` series)."""
    sum: float = 0.0

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def since(self, older: HistogramSample) -> HistogramSample:
        """The observations made after ``older``; all of them when the counters restarted in between
        (a restarted engine) or the buckets differ."""
        if older.bounds != self.bounds or any(
            new < old for new, old in zip(self.cumulative, older.cumulative, strict=True)
        ):
            return self
        cumulative = tuple(new - old for new, old in zip(self.cumulative, older.cumulative, strict=True))
        return HistogramSample(self.bounds, cumulative, max(0.0, self.sum - older.sum))

    def plus(self, other: HistogramSample) -> HistogramSample:
        """Both histograms' observations together (same buckets; ``other`` is ignored otherwise)."""
        if other.bounds != self.bounds:
            return self
        cumulative = tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True))
        return HistogramSample(self.bounds, cumulative, self.sum + other.sum)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, interpolated inside its bucket as Prometheus' ``histogram_quantile`` does;
        None without observations.

        vLLM's request-latency buckets start at 0.3 s, so a quantile that lands in the first bucket says
        only "under 0.3 s": there the mean of the observations (exact, from ``_sum``) stands in, capped at
        the bucket's bound, instead of an interpolation that would put an idle queue at 0.27 s.
        """
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for index, (bound, cumulative) in enumerate(zip(self.bounds, self.cumulative, strict=True)):
            if cumulative >= rank and cumulative > below:
                if index == 0:
                    return min(self.sum / total, bound)
                if bound == float("inf"):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower


def _labels(line: str) -> dict[str, str]:
    """The labels of one sample line (values with escaped quotes are rare here and kept verbatim)."""
    brace = line.find("{")
    end = line.rfind("}")
    if brace == -1 or end < brace:
        return {}
    out: dict[str, str] = {}
    for part in line[brace + 1 : end].split('",'):
        key, _, value = part.partition("=")
        out[key.strip().strip(",")] = value.strip().strip('"')
    return out


def parse_histogram(text: str, name: str, match: dict[str, str] | None = None) -> HistogramSample | None:
    """The histogram ``name`` of a ``/metrics`` page, summed over its series whose labels contain
    ``match``; None when the page has no bucket of it."""
    buckets: dict[float, float] = {}
    total = 0.0
    prefix = name + "_"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        sample = _sample(line)
        if sample is None:
            continue
        series, value = sample
        if series not in {name + "_bucket", name + "_sum"}:
            continue
        labels = _labels(line)
        if match and any(labels.get(k) != v for k, v in match.items()):
            continue
        if series == name + "_sum":
            total += value
            continue
        try:
            bound = float(labels.get("le", ""))
        except ValueError:
            continue
        buckets[bound] = buckets.get(bound, 0.0) + value
    if not buckets:
        return None
    bounds = tuple(sorted(buckets))
    return HistogramSample(bounds, tuple(buckets[b] for b in bounds), total)


def parse_counters(text: str, name: str, label: str) -> dict[str, float]:
    """The samples of series ``name`` (a counter's ``…_total``) on a ``/metrics`` page, summed by the
    value of ``label`` (samples without it are left out)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        sample = _sample(line)
        if sample is None or sample[0] != name:
            continue
        value = _labels(line).get(label)
        if value is not None:
            out[value] = out.get(value, 0.0) + sample[1]
    return out
