"""End to end on a real vLLM (CPU build): deploy → OpenAI requests (stream and not) → status → undeploy.

The deployment is the session's shared ``vllm_tiny`` fixture (one vLLM start per session); its
teardown runs ``llmctl undeploy`` and fails if any vLLM process is left.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fixtures.vllm import VllmDeployment, group_members

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_deployed_replica_answers_the_official_openai_client(vllm_tiny: VllmDeployment) -> None:
    import openai

    key = vllm_tiny.engine_key(vllm_tiny.model)
    assert key is not None
    # The deployment's engine key guards /v1/*: without it vLLM refuses the request.
    assert httpx.get(f"{vllm_tiny.base_url}/models", timeout=30).status_code == 401
    assert key not in Path(f"/proc/{vllm_tiny.pid}/cmdline").read_bytes().decode(errors="replace")
    client = openai.OpenAI(base_url=vllm_tiny.base_url, api_key=key, timeout=120, max_retries=0)
    models = [m.id for m in client.models.list()]
    assert models == ["sarv-tiny"]
    msg = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(model="sarv-tiny", messages=msg, max_tokens=8)  # type: ignore[arg-type]
    assert reply.choices[0].message.content is not None
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(model="sarv-tiny", messages=msg, max_tokens=8, stream=True)  # type: ignore[arg-type]
    chunks = [c for c in stream if c.choices]
    assert len(chunks) >= 2
    assert chunks[-1].choices[0].finish_reason in {"length", "stop"}


def test_status_reports_the_ready_replica(vllm_tiny: VllmDeployment) -> None:
    [dep] = vllm_tiny.status()["deployments"]
    assert dep["name"] == "sarv-tiny" and dep["engine"] == "vllm-cpu"
    [replica] = dep["replicas"]
    assert replica["state"] == "ready"
    assert replica["endpoint"] == vllm_tiny.endpoint
    assert replica["pid"] == vllm_tiny.pid
    # vLLM's own workers run in the replica's process group (stopped together by undeploy).
    assert vllm_tiny.pid in group_members(vllm_tiny.pid)
    metrics = httpx.get(f"{vllm_tiny.endpoint}/metrics", timeout=30).text
    assert "vllm:num_requests_running" in metrics


def test_deploying_again_changes_nothing(vllm_tiny: VllmDeployment) -> None:
    out = vllm_tiny.llmctl("deploy", "sarv-tiny", "--engine", "vllm-cpu", "--tools", check=True)
    assert "unchanged" in out.stdout
    assert vllm_tiny.replica_pids() == [vllm_tiny.pid]


def test_logs_show_the_engine_output(vllm_tiny: VllmDeployment) -> None:
    out = vllm_tiny.llmctl("logs", "sarv-tiny-0", "--tail", "0", check=True).stdout
    assert "starting sarv-tiny-0" in out
    assert "vllm.entrypoints.openai.api_server" in out
    assert "Application startup complete" in out or "Starting vLLM" in out


def test_the_engine_metrics_parser_reads_this_vllm(vllm_tiny: VllmDeployment) -> None:
    from controlplane.engines.metrics import parse_vllm_metrics

    [replica] = vllm_tiny.status()["deployments"][0]["replicas"]
    assert replica["probe"] == {"path": "/health", "ok": True, "error": None}
    load = parse_vllm_metrics(httpx.get(f"{vllm_tiny.endpoint}/metrics", timeout=30).text)
    assert load is not None
    assert load.ongoing == 0.0  # idle between the tests' requests
    assert load.kv_cache_usage is not None and 0.0 <= load.kv_cache_usage <= 1.0
    assert load.queued_requests_total is not None  # the queue-time histogram under this release's name
