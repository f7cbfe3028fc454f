"""The engine key: each deployment's replicas require it on ``/v1/*``; it never shows in argv or status."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import httpx
from fixtures.controller import llmctl_env
from fixtures.vllm import LlmctlEnv

__all__ = ["llmctl_env"]  # the fixture, used by name

_CHAT = {"model": "sarv-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_deployment_gets_an_engine_key_its_replica_enforces(llmctl_env: LlmctlEnv) -> None:
    env = llmctl_env
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "-o", "json", check=True)
    key = env.engine_key("sarv-tiny")
    assert key is not None and len(key) >= 32
    assert key not in out.stdout and key not in out.stderr
    status = env.llmctl("status", "-o", "json", check=True).stdout
    assert key not in status
    [replica] = json.loads(status)["deployments"][0]["replicas"]
    assert replica["state"] == "ready"
    url = f"{replica['endpoint']}/v1/chat/completions"
    assert httpx.post(url, json=_CHAT, timeout=30).status_code == 401
    bad = httpx.post(url, json=_CHAT, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert bad.status_code == 401
    good = httpx.post(url, json=_CHAT, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert good.status_code == 200, good.text
    # Never in the process list; the environment is readable by the replica's user only.
    pid = replica["pid"]
    assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    assert stat.S_IMODE(os.stat(f"/proc/{pid}/environ").st_mode) & 0o077 == 0
    log = (env.home / "replicas").rglob("*.log")
    assert all(key not in p.read_text(errors="replace") for p in log)
    # Deploying the same spec again changes nothing, the key included; undeploy forgets it.
    again = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", check=True)
    assert "unchanged" in again.stdout
    assert env.engine_key("sarv-tiny") == key
    env.llmctl("undeploy", "sarv-tiny", "--yes", check=True)
    assert env.engine_key("sarv-tiny") is None
