"""``llmctl rollout`` as a user runs it: real subprocesses, sim replicas on a declared GPU fleet of this
host, SQLite state, no controller (promote and abort act at once)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.fleets import gpu_fleet, llmctl_on_fleet
from fixtures.vllm import LlmctlEnv


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlmctlEnv]:
    with llmctl_on_fleet(tmp_path_factory.mktemp("rollout"), gpu_fleet(nodes=3, gpus=1)) as e:
        e.llmctl("deploy", "sarv-tiny", "--name", "web", "--engine", "sim", check=True, timeout=180)
        yield e


def replicas(env: LlmctlEnv) -> list[dict[str, object]]:
    [web] = env.status()["deployments"]
    return web["replicas"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["web", "--set", "colour=blue"], "--set colour: not a deployment field"),
        (["web", "--set", "replicas=3"], "--set replicas: the replica count changes with `llmctl scale`"),
        (["web", "--set", "engine_args.max_num_seqs"], "must be KEY=VALUE"),
        (["web"], "nothing to roll out"),
        (["web", "--set", "gpu_memory_utilization=2"], "gpu_memory_utilization"),
        (["web", "--set", "engine_args.seed=0", "--steps", "50,20"], "must increase"),
        (["web", "--set", "engine_args.seed=0", "--steps", "10,x"], "must be percentages"),
        (["nope", "--set", "engine_args.seed=1"], "no deployment named 'nope'"),
        (["status", "web"], "deployment web has no rollout in progress"),
        (["abort", "web"], "deployment web has no rollout in progress"),
        (["undo", "web"], "unknown rollout action 'undo'"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(env: LlmctlEnv, args: list[str], message: str) -> None:
    before = replicas(env)
    out = env.llmctl("rollout", *args)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert replicas(env) == before


def test_start_promote_to_the_end_then_a_second_rollout_aborted(env: LlmctlEnv, tmp_path: Path) -> None:
    (old,) = replicas(env)
    started = env.llmctl(
        "rollout", "web", "--set", "engine_args.ttft_ms=40", "--steps", "50,100", check=True, timeout=180
    )
    assert "web: rollout progressing, step 1 of 2 (50%, 100%)" in started.stdout
    assert "change: engine_args.ttft_ms=40" in started.stdout
    again = env.llmctl("rollout", "web", "--set", "engine_args.ttft_ms=50")
    assert again.returncode == 2 and "already has a rollout in progress" in again.stderr
    assert env.llmctl("scale", "web", "3").returncode == 2, "no scaling under a rollout"
    doc = json.loads(env.llmctl("rollout", "status", "web", "-o", "json", check=True).stdout)
    assert doc["weight"] == 50
    assert [(v["role"], v["weight"], len(v["replicas"])) for v in doc["versions"]] == [
        ("stable", 50, 1),
        ("canary", 50, 1),
    ]

    env.llmctl("rollout", "promote", "web", check=True, timeout=180)  # to 100 %: the old replica goes
    assert old["id"] not in {r["id"] for r in replicas(env)}
    done = env.llmctl("rollout", "promote", "web", "-o", "json", check=True, timeout=180)
    assert json.loads(done.stdout)["status"] == "succeeded"
    (new,) = replicas(env)
    assert new["state"] == "ready"

    env.llmctl("rollout", "web", "--set", "engine_args.ttft_ms=90", check=True, timeout=180)
    assert len(replicas(env)) == 2
    aborted = env.llmctl("rollout", "abort", "web", check=True, timeout=180)
    assert "rollout rolled-back" in aborted.stdout
    assert replicas(env) == [new], "exactly the version before the aborted rollout, the same replica"
    reasons = [e["reason"] for e in json.loads(env.llmctl("events", "web", "-o", "json", check=True).stdout)]
    assert reasons.count("RolloutStarted") == 2
    assert {"RolloutPromoted", "RolloutSucceeded", "RollingBack", "RolledBack"} <= set(reasons)
