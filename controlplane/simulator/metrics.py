"""vLLM's Prometheus series (same names, types, labels and buckets as the installed vLLM) for the simulator.

Written by hand rather than with prometheus_client: the simulator runs on one event loop, so it needs no
locks, and observing a token must stay cheap at hundreds of concurrent streams. The text exposition
format is the one prometheus_client writes (counters get ``_total``), checked in tests with its parser.
"""

from __future__ import annotations

import time
from bisect import bisect_left

__all__ = ["SimMetrics"]

# Bucket boundaries copied from vllm/v1/metrics/buckets.py so dashboards and quantiles line up.
_REQUEST_LATENCY = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_TTFT = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0,
)  # fmt: skip


def _token_buckets(max_model_len: int) -> tuple[float, ...]:
    # vLLM's request_tokens family: 1-2-5 steps up to max_model_len.
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


def _fmt(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n


class SimMetrics:
    """Counters, gauges and histograms of one replica, rendered as Prometheus text."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        adapters: list[str],
        max_lora: int,
        cache_info: dict[str, str] | None = None,
    ) -> None:
        # vLLM's cache_config_info labels (a subset: what routers read to size a replica's KV cache).
        self._cache_info = ",".join(
            f'{k}="{_escape(v)}"' for k, v in {**(cache_info or {}), "engine": "0"}.items()
        )
        self._labels = f'model_name="{_escape(model_name)}",engine="0"'
        self._max_lora = max_lora
        self.lora_running: dict[str, int] = dict.fromkeys(adapters, 0)
        self.lora_waiting: dict[str, int] = dict.fromkeys(adapters, 0)
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.sleep_level = 0
        """0 awake, 1 weights offloaded, 2 weights discarded (vLLM's engine_sleep_state)."""
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        tokens = _token_buckets(max_model_len)
        self.ttft = Histogram(_TTFT)
        self.itl = Histogram(_ITL)
        self.e2e = Histogram(_REQUEST_LATENCY)
        self.queue = Histogram(_REQUEST_LATENCY)
        self.prefill = Histogram(_REQUEST_LATENCY)
        self.decode = Histogram(_REQUEST_LATENCY)
        self.inference = Histogram(_REQUEST_LATENCY)
        self.request_prompt = Histogram(tokens)
        self.request_generation = Histogram(tokens)
        self.request_max_tokens = Histogram(tokens)

    def render(self) -> bytes:
        lb = self._labels
        out: list[str] = []

        def family(name: str, kind: str, doc: str) -> None:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")

        def scalar(name: str, kind: str, doc: str, value: float) -> None:
            family(name, kind, doc)
            out.append(f"{name}{{{lb}}} {_fmt(value)}\n")

        def histogram(name: str, doc: str, h: Histogram) -> None:
            family(name, "histogram", doc)
            cumulative = 0
            for bound, n in zip((*h.bounds, float("inf")), h.counts, strict=True):
                cumulative += n
                out.append(f'{name}_bucket{{{lb},le="{_fmt(bound)}"}} {_fmt(cumulative)}\n')
            out.append(f"{name}_count{{{lb}}} {_fmt(h.count)}\n{name}_sum{{{lb}}} {_fmt(h.sum)}\n")

        family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
        out.append(f"vllm:cache_config_info{{{self._cache_info}}} 1.0\n")
        scalar(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            self.running,
        )
        scalar(
            "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", self.waiting
        )
        scalar(
            "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", self.kv_usage
        )
        scalar(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            self.prefix_queries,
        )
        scalar(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            self.prefix_hits,
        )
        scalar(
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemption from the engine.",
            self.preemptions,
        )
        scalar(
            "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens
        )
        scalar(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            self.generation_tokens,
        )
        family("vllm:engine_sleep_state", "gauge", "Engine sleep state; awake = 1 means engine is awake.")
        for state, value in (
            ("awake", self.sleep_level == 0),
            ("weights_offloaded", self.sleep_level == 1),
            ("discard_all", self.sleep_level == 2),
        ):
            out.append(f'vllm:engine_sleep_state{{{lb},sleep_state="{state}"}} {_fmt(int(value))}\n')
        family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
        for reason, n in self.success.items():
            out.append(f'vllm:request_success_total{{{lb},finished_reason="{reason}"}} {_fmt(n)}\n')
        histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", self.request_prompt)
        histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            self.request_generation,
        )
        histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            self.request_max_tokens,
        )
        histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft
        )
        histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl
        )
        histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e
        )
        histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            self.queue,
        )
        histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            self.inference,
        )
        histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            self.prefill,
        )
        histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            self.decode,
        )
        if self._max_lora:
            family("vllm:lora_requests_info", "gauge", "Running stats on lora requests.")
            running = ",".join(a for a, n in self.lora_running.items() if n > 0)
            waiting = ",".join(a for a, n in self.lora_waiting.items() if n > 0)
            # vLLM publishes the adapter lists as label values of one gauge whose value is a timestamp.
            out.append(
                f'vllm:lora_requests_info{{max_lora="{self._max_lora}",'
                f'running_lora_adapters="{_escape(running)}",waiting_lora_adapters="{_escape(waiting)}"}} '
                f"{_fmt(time.time())}\n"
            )
        return "".join(out).encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
