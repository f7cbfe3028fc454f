"""The one vLLM metrics parser: the load measures, across vLLM's metric renames."""

from __future__ import annotations

import pytest

from controlplane.engines.metrics import VllmLoad, parse_vllm_metrics

_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 2.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 4.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.75
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="llama"} 7.0
vllm:request_queue_time_seconds_count{engine="0",model_name="llama"} 8.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="llama"} 2.5
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0
python_gc_objects_collected_total{generation="0"} 123.0
"""

# vLLM < 0.10 (V0 engine): gpu_cache_usage_perc and time_in_queue_requests.
_V0 = """\
vllm:num_requests_running{model_name="llama"} 1.0
vllm:num_requests_waiting{model_name="llama"} 0.0
vllm:gpu_cache_usage_perc{model_name="llama"} 0.25
vllm:time_in_queue_requests_sum{model_name="llama"} 1.5
vllm:time_in_queue_requests_count{model_name="llama"} 3.0
"""


def test_v1_page_sums_over_engines_and_takes_the_fullest_kv_cache() -> None:
    assert parse_vllm_metrics(_V1) == VllmLoad(
        waiting=5.0, running=5.0, kv_cache_usage=0.75, queue_time_s_total=2.5, queued_requests_total=8.0
    )


def test_v0_names_read_as_the_same_measures() -> None:
    load = parse_vllm_metrics(_V0)
    assert load == VllmLoad(
        waiting=0.0, running=1.0, kv_cache_usage=0.25, queue_time_s_total=1.5, queued_requests_total=3.0
    )
    assert load.ongoing == 1.0


def test_a_page_with_old_and_new_names_counts_each_measure_once() -> None:
    both = _V0 + 'vllm:kv_cache_usage_perc{model_name="llama"} 0.125\n'
    both += 'vllm:request_queue_time_seconds_sum{model_name="llama"} 1.5\n'
    load = parse_vllm_metrics(both)
    assert load is not None
    assert (load.kv_cache_usage, load.queue_time_s_total) == (0.125, 1.5)


def test_label_values_with_spaces_and_braces_and_timestamps() -> None:
    text = 'vllm:num_requests_running{model_name="a b} c",engine="0"} 2 1700000000000\n'
    load = parse_vllm_metrics(text)
    assert load is not None
    assert (load.running, load.waiting, load.ongoing) == (2.0, None, 2.0)


@pytest.mark.parametrize(
    "text", ["", "foo 1\n", "# vllm:num_requests_running 3\n", "vllm:num_requests_running x\n"]
)
def test_no_load_series_is_none(text: str) -> None:
    assert parse_vllm_metrics(text) is None


def test_kv_usage_alone_reports_no_ongoing_requests() -> None:
    load = parse_vllm_metrics('vllm:kv_cache_usage_perc{engine="0"} 0.5\n')
    assert load is not None and load.ongoing is None


def test_only_whole_names_count_and_crlf_pages_parse() -> None:
    # A series whose name extends a read one is not that one; a first line needs no newline before it.
    text = "vllm:num_requests_waiting 2\r\nvllm:num_requests_waiting_total 40\r\n"
    text += '  vllm:num_requests_running 7\r\nvllm:num_requests_running{a="1"}\t3\r\n'
    load = parse_vllm_metrics(text)
    assert load is not None
    assert (load.waiting, load.running) == (2.0, 3.0)
