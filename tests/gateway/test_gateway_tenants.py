"""Teams and the organisation: limits at every level (in one process, on real Redis and Redis Cluster),
x-ratelimit headers, usage accounting through the state store, the access log and ``llmctl usage``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
from fixtures.common import free_port
from fixtures.gateway import add_key, add_replica, make_store

from controlplane.gateway import GatewayConfig
from controlplane.gateway.ratelimit import (
    Admitted,
    InProcessLimiter,
    KeyLimits,
    Level,
    RedisLimiter,
    Refused,
    admit_levels,
    month_of_day,
)
from controlplane.state.base import TeamRecord, UsageRecord

T0 = 1_700_000_040.0  # a window boundary (divisible by 60)


def _levels(key: str, key_limits: KeyLimits, team: KeyLimits, org: KeyLimits) -> tuple[Level, ...]:
    return (
        Level("key", key, f"k-{key}", key_limits),
        Level("team", "ml", "team:ml", team),
        Level("organisation", "", "org", org),
    )


async def test_levels_in_one_process_refuse_naming_the_level_and_roll_back():
    lim = InProcessLimiter()
    levels = _levels("a", KeyLimits(rpm=10), KeyLimits(rpm=3, tpm=1000), KeyLimits(tpm=10_000))
    results = [await admit_levels(lim, levels, 100, T0 + i) for i in range(4)]
    assert [isinstance(r, Admitted) for r in results] == [True, True, True, False]
    refused = results[3]
    assert isinstance(refused, Refused)
    assert (refused.level.kind, refused.decision.reason) == ("team", "rpm")
    first = results[0]
    assert isinstance(first, Admitted)
    assert len(first.reservations) == 3
    # the tightest level: the team has 2 requests left of 3, the key 9 of 10
    assert first.requests == (3, 2)
    assert first.tokens == (1000, 900)
    # the key's admission of the refused request was given back: 3 requests counted, not 4
    assert lim._get("k-a", "r", int(T0 // 60)) == 3
    assert lim._get("org", "t", int(T0 // 60)) == 300

    monthly = (Level("team", "ml", "team:m", KeyLimits(monthly_tokens=150)),)
    assert isinstance(await admit_levels(lim, monthly, 100, T0), Admitted)
    refused = await admit_levels(lim, monthly, 100, T0 + 86400 * 3)  # later days, same month
    assert isinstance(refused, Refused)
    assert refused.decision.reason == "monthly"
    assert refused.decision.retry_after == pytest.approx(month_of_day(int(T0 // 86400))[1] - T0 - 86400 * 3)


def test_month_of_day_ends_at_the_next_month():
    dec_31 = 1_703_980_800 // 86400  # 2023-12-31
    month, end = month_of_day(dec_31)
    assert month == 2023 * 12 + 11
    assert end == 1_704_067_200  # 2024-01-01T00:00Z


def _limiter(url: str, **kw) -> RedisLimiter:
    from controlplane.settings import Settings
    from controlplane.state.clients import async_client, redis_endpoint

    client = async_client(
        redis_endpoint(url, Settings()), timeout_s=10, max_connections=64, pool_timeout_s=10
    )
    return RedisLimiter(client, prefix=f"t{uuid.uuid4().hex[:6]}:", fail_open=False, **kw)


def _counter(url: str, prefix: str, subject: str, kind: str, n: int) -> int:
    from controlplane.settings import Settings
    from controlplane.state.clients import redis_endpoint, sync_client

    client = sync_client(redis_endpoint(url, Settings()))
    try:
        return int(client.get(f"{prefix}rl:{{{subject}}}:{kind}:{n}") or 0)
    finally:
        client.close()


@pytest.mark.redis
@pytest.mark.parametrize("backend", ["redis", "cluster"])
@pytest.mark.parametrize(
    ("team_rpm", "requests"),
    [(400, 1_200), (10_000, 14_000)],
    ids=["per-request", "leased"],
)
async def test_levels_across_gateways_do_not_over_admit(request, backend, team_rpm, requests):
    url = (
        request.getfixturevalue("redis_url")
        if backend == "redis"
        else request.getfixturevalue("redis_cluster").url
    )
    # Four gateways; three keys of one team; the team's rpm binds, one key's own rpm binds before it.
    first = _limiter(url)
    prefix = first._prefix
    limiters = [first] + [_limiter(url) for _ in range(3)]
    for lim in limiters:
        lim._prefix = prefix
    key_rpm = {"a": team_rpm, "b": team_rpm, "c": team_rpm // 10}
    org = KeyLimits(rpm=team_rpm * 4, tpm=team_rpm * 1000)
    gate = asyncio.Semaphore(256)  # many at once; the limiter bounds its own Redis calls

    async def one(i: int) -> tuple[str, bool, bool]:
        key = "abc"[i % 3]
        levels = _levels(key, KeyLimits(rpm=key_rpm[key]), KeyLimits(rpm=team_rpm), org)
        async with gate:
            r = await admit_levels(limiters[i % 4], levels, 10, T0 + (i % 50) / 100)
        return key, isinstance(r, Admitted), isinstance(r, Refused) and r.decision.backend_error

    try:
        results = await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        for lim in limiters:
            await lim.close()
    assert not any(err for *_, err in results)
    admitted = {k: sum(1 for key, ok, _ in results if ok and key == k) for k in "abc"}
    total = sum(admitted.values())
    assert total <= team_rpm, "the team's limit holds across gateways"
    assert total >= team_rpm * (1 - 0.01), "and it under-admits by less than 1 %"
    assert admitted["c"] <= key_rpm["c"]
    window = int(T0 // 60)
    # every level's counter holds exactly what was admitted: refusals by the team gave the keys' back
    assert _counter(url, prefix, "team:ml", "r", window) == total
    assert _counter(url, prefix, "org", "r", window) == total
    assert _counter(url, prefix, "org", "t", window) == total * 10
    for k in "abc":
        assert _counter(url, prefix, f"k-{k}", "r", window) == admitted[k]


# --- through the gateway


@pytest.fixture
def tenant_gateway(tmp_path, sim_server, gateway_factory):
    sim = sim_server(served_model_name="m1", latency_mode="fixed", fixed_ttft_ms=1, fixed_output_tokens=2)
    store = make_store(tmp_path)
    add_replica(store, sim.url, "m1", rid="m1-0")

    def start(**config):
        return gateway_factory(store, GatewayConfig.model_validate(config))

    return store, start


def _post(gw, key: str, **body) -> httpx.Response:
    return httpx.post(
        f"{gw.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "m1", "prompt": "hello", "max_tokens": 2} | body,
    )


def test_team_limits_headers_usage_and_access_log(tenant_gateway, tmp_path):
    store, start = tenant_gateway
    store.put_team(TeamRecord(name="ml", rpm=3, tpm=100_000))
    bot = add_key(store, "bot", team="ml", rpm=100)
    solo = add_key(store, "solo")
    log = tmp_path / "access.jsonl"
    gw = start(
        models={"m1": {"prompt_price_per_1k": 2.0, "completion_price_per_1k": 10.0}},
        access_log={"enabled": True, "path": str(log), "flush_interval_s": 0.1},
        usage_flush_interval_s=60,
    )
    ok = _post(gw, bot)
    assert ok.status_code == 200, ok.text
    # the team (3 rpm) is tighter than the key (100 rpm)
    assert ok.headers["x-ratelimit-limit-requests"] == "3"
    assert ok.headers["x-ratelimit-remaining-requests"] == "2"
    assert ok.headers["x-ratelimit-reset-requests"] == "20s"
    assert ok.headers["x-ratelimit-limit-tokens"] == "100000"
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) < 100_000
    assert [_post(gw, bot).status_code for _ in range(3)] == [200, 200, 429]
    refused = _post(gw, bot)
    assert refused.status_code == 429
    err = refused.json()["error"]
    assert err["type"] == "rate_limit_error"
    assert err["code"] == "rate_limit_exceeded"
    assert "team 'ml' is limited to 3 requests per minute" in err["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-sarv-ratelimit-level"] == "team"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert _post(gw, solo).status_code == 200  # another key, no team: not limited by the team
    assert "x-ratelimit-limit-requests" not in _post(gw, solo).headers  # no limits, no headers

    metrics = httpx.get(gw.metrics_url).text
    assert 'sarv_gateway_requests_total{key="bot",model="m1",status="200",team="ml"} 3.0' in metrics
    assert 'sarv_gateway_requests_total{key="solo",model="m1",status="200",team=""} 2.0' in metrics
    assert 'sarv_gateway_ratelimit_rejections_total{key="bot",reason="team_rpm",team="ml"} 2.0' in metrics
    assert 'sarv_gateway_prompt_tokens_total{key="bot",model="m1",team="ml"}' in metrics
    assert 'sarv_gateway_cost_total{key="bot",model="m1",team="ml"}' in metrics

    gw.stop()  # shutdown flushes usage and the access log
    rows = {r.key: r for r in store.list_usage()}
    assert set(rows) == {"bot", "solo"}
    b = rows["bot"]
    assert (b.team, b.model, b.requests, b.rejected, b.errors) == ("ml", "m1", 5, 2, 0)
    assert b.completion_tokens == 3 * 2
    assert b.cost == pytest.approx((b.prompt_tokens * 2.0 + b.completion_tokens * 10.0) / 1000)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 7
    assert log.stat().st_mode & 0o077 == 0
    first = lines[0]
    assert {k: first[k] for k in ("key", "team", "model", "path", "status", "replica", "retried")} == {
        "key": "bot",
        "team": "ml",
        "model": "m1",
        "path": "/v1/completions",
        "status": 200,
        "replica": "m1-0",
        "retried": False,
    }
    assert first["request_id"] == ok.headers["x-request-id"]
    assert first["completion_tokens"] == 2
    assert first["latency_s"] > 0
    text = log.read_text()
    assert "hello" not in text, "no prompt content unless include_content"
    assert bot not in text
    assert solo not in text


def test_retried_request_counts_once(tenant_gateway, tmp_path):
    store, start = tenant_gateway
    # a replica that refuses connections, preferred by name order: the gateway retries on m1-0
    add_replica(store, f"http://127.0.0.1:{free_port()}", "m1", rid="m1-0dead")
    key = add_key(store, "bot")
    log = tmp_path / "access.jsonl"
    gw = start(
        routing={"policy": "round-robin", "eject_after_failures": 100},
        access_log={"enabled": True, "path": str(log), "include_content": True},
    )
    codes = [_post(gw, key).status_code for _ in range(4)]
    assert codes == [200] * 4
    text = httpx.get(gw.metrics_url).text
    retries = next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("sarv_gateway_retries_total")
    )
    assert retries >= 1
    gw.stop()
    [row] = store.list_usage()
    assert (row.requests, row.errors, row.completion_tokens) == (4, 0, 8)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(line["retried"] for line in lines) == retries
    assert all(line["replica"] == "m1-0" for line in lines)
    assert '"prompt":"hello"' in lines[0]["request"].replace(" ", ""), "content when the operator asks"


def test_access_log_with_content_keeps_the_answer_as_sent(tenant_gateway, tmp_path):
    store, start = tenant_gateway
    key = add_key(store, "auditor")
    log = tmp_path / "access.jsonl"
    gw = start(access_log={"enabled": True, "path": str(log), "include_content": True})
    whole = _post(gw, key)
    streamed = _post(gw, key, stream=True)
    plain = start(access_log={"enabled": True, "path": str(tmp_path / "plain.jsonl")})
    _post(plain, key)
    gw.stop()
    plain.stop()
    by_id = {line["request_id"]: line for line in map(json.loads, log.read_text().splitlines())}
    assert by_id[whole.headers["x-request-id"]]["response"] == whole.text
    assert by_id[streamed.headers["x-request-id"]]["response"] == streamed.text
    assert streamed.text.rstrip().endswith("data: [DONE]")
    [line] = map(json.loads, (tmp_path / "plain.jsonl").read_text().splitlines())
    assert "response" not in line and "request" not in line, "no content unless the operator asks"


def test_team_and_organisation_models_and_prompt_caps(tenant_gateway):
    store, start = tenant_gateway
    store.put_team(TeamRecord(name="ml", models=["other"]))
    store.put_team(TeamRecord(name="short", max_prompt_tokens=1))
    in_ml = add_key(store, "in-ml", team="ml")
    in_short = add_key(store, "in-short", team="short")
    solo = add_key(store, "solo")
    gw = start(organisation={"tpm": 1_000_000, "max_prompt_tokens": 1000})
    r = _post(gw, in_ml)
    assert r.status_code == 403
    assert "team 'ml' may not use the model 'm1'" in r.json()["error"]["message"]
    listed = httpx.get(f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {in_ml}"}).json()["data"]
    assert listed == [], "the list shows only what every level allows"
    card = httpx.get(f"{gw.url}/v1/models/m1", headers={"Authorization": f"Bearer {in_ml}"})
    assert card.status_code == 404
    listed = httpx.get(f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {solo}"}).json()["data"]
    assert [m["id"] for m in listed] == ["m1"]
    r = _post(gw, in_short, prompt="hello " * 20)
    assert r.status_code == 400
    assert "team 'short' allows at most 1" in r.json()["error"]["message"]
    r = _post(gw, solo, prompt="hello " * 2000)
    assert r.status_code == 400
    assert "the organisation allows at most 1000" in r.json()["error"]["message"]
    ok = _post(gw, solo)
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-limit-tokens"] == "1000000"  # the organisation's is the only one
    gw.stop()
    rows = {r.key: r for r in store.list_usage()}
    assert (rows["in-ml"].requests, rows["in-ml"].errors) == (1, 1)
    assert (rows["solo"].requests, rows["solo"].errors) == (2, 1)


def test_organisation_rpm_refuses_as_the_organisation(tenant_gateway):
    store, start = tenant_gateway
    a, b = add_key(store, "a"), add_key(store, "b")
    gw = start(organisation={"rpm": 2})
    assert [_post(gw, k).status_code for k in (a, b, a)] == [200, 200, 429]
    r = _post(gw, b)
    assert "the organisation is limited to 2 requests per minute" in r.json()["error"]["message"]
    assert r.headers["x-sarv-ratelimit-level"] == "organisation"


# --- llmctl usage


@pytest.fixture
def usage_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("COLUMNS", "200")
    (tmp_path / "absent.yaml").write_text("{}\n")
    monkeypatch.setenv("SARV_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("SARV_HOME", str(tmp_path))
    monkeypatch.setenv("SARV_STATE_URL", f"sqlite:///{tmp_path / 'state.db'}")
    store = make_store(tmp_path)
    now = int(time.time() // 3600) * 3600
    store.add_usage(
        [
            UsageRecord(hour=now, key="bot", team="ml", model="m1", requests=3, prompt_tokens=30,
                        completion_tokens=6, cost=0.5),
            UsageRecord(hour=now - 3600, key="bot", team="ml", model="m2", requests=1, prompt_tokens=10,
                        errors=1),
            UsageRecord(hour=now - 86400 * 3, key="old", team="", model="m1", requests=7, rejected=2),
        ]
    )  # fmt: skip
    store.close()
    return now


def _run(capsys, *args: str) -> tuple[int, str, str]:
    from controlplane.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_llmctl_usage_filters_and_formats(capsys, usage_cli):
    code, out, err = _run(capsys, "usage", "-o", "json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["key"], r["model"]) for r in rows] == [("bot", "m2"), ("bot", "m1")], (
        "the last 24 h by default"
    )
    assert rows[1]["cost"] == 0.5
    code, out, _ = _run(capsys, "usage", "--since", "7d", "--team", "", "-o", "json")
    assert [r["key"] for r in json.loads(out)] == ["old"]
    code, out, _ = _run(capsys, "usage", "--since", "7d", "--model", "m1", "-o", "csv")
    lines = out.splitlines()
    assert lines[0].startswith("hour,key,team,model,requests,prompt_tokens,completion_tokens,errors,rejected")
    assert len(lines) == 3
    code, out, _ = _run(capsys, "usage", "--key", "bot", "--by", "key")
    assert code == 0
    assert "bot" in out
    assert "40" in out  # 30 + 10 prompt tokens, summed over the hours
    code, out, _ = _run(capsys, "usage", "--until", "2000-01-01", "-o", "json")
    assert json.loads(out) == []
    code, _, err = _run(capsys, "usage", "--since", "soon")
    assert code == 2
    assert "neither a duration" in err


@pytest.mark.parametrize("fail_open", [True, False])
async def test_unreachable_cluster_follows_the_setting(fail_open):
    from controlplane.settings import Settings
    from controlplane.state.clients import async_client, redis_endpoint

    url = f"redis+cluster://127.0.0.1:{free_port()}"
    lim = RedisLimiter(async_client(redis_endpoint(url, Settings())), fail_open=fail_open)
    levels = _levels("a", KeyLimits(rpm=1), KeyLimits(rpm=1), KeyLimits())
    try:
        result = await admit_levels(lim, levels, 1, T0)
    finally:
        await lim.close()
    if fail_open:
        assert isinstance(result, Admitted)
        assert result.unchecked == 2
    else:
        assert isinstance(result, Refused)
        assert result.decision.backend_error
