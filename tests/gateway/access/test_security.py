"""Auth, origins, CORS and per-key limits, against real gateway processes.

No model: a WorkerStore heartbeat stands in for a live worker (requests stay
queued), which is all these checks need.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.gateway.procs import Client, Proc, start_gateway, stop_all, wait_ready
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.gateway.access.auth import Authenticator, key_id, key_id_secret, load_keys
from tokenrelay.gateway.access.cors import OriginPolicy
from tokenrelay.gateway.access.hosts import HostPolicy
from tokenrelay.gateway.errors import AuthError
from tokenrelay.worker.store import WorkerStore

KEY_A = "sk-test-alpha-0123456789"
KEY_B = "sk-test-bravo-0123456789"
PREFIX = "sec:"


# --- units -------------------------------------------------------------------------


def test_keys_from_env_and_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# team keys\n{KEY_B}  # bravo\n\n{KEY_A}\n")
    assert load_keys(f"{KEY_A}, ", str(f)) == (KEY_A, KEY_B)
    with pytest.raises(ValueError, match="api-keys-file"):
        load_keys(None, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="whitespace"):
        load_keys("sk-a\tb", None)


def test_ws_tokens_are_signed_expire_and_die_with_their_key() -> None:
    auth = Authenticator([KEY_A, KEY_B], token_ttl=60)
    secret = key_id_secret([KEY_A, KEY_B])  # no --key-id-secret: derived from the keys
    token, expires = auth.issue_token(key_id(KEY_A, secret), now=1000)
    assert expires == 1060 and KEY_A not in token
    assert auth.check_token(token, now=1059) == key_id(KEY_A, secret)
    with pytest.raises(AuthError, match="expired"):
        auth.check_token(token, now=1061)
    parts = token.split(".")
    for forged in (
        ".".join([*parts[:2], "9999999999", *parts[3:]]),  # extended expiry
        ".".join([parts[0], key_id(KEY_B, secret), *parts[2:]]),  # other key
        token[:-2] + ("AA" if not token.endswith("AA") else "BB"),
        "v1.x.1.y",
        "",
    ):
        with pytest.raises(AuthError):
            auth.check_token(forged, now=1000)
    # another gateway with the same keys accepts it; without KEY_A it is revoked
    assert Authenticator([KEY_B, KEY_A]).check_token(token, now=1000) == key_id(KEY_A, secret)
    with pytest.raises(AuthError):
        Authenticator([KEY_B]).check_token(token, now=1000)
    assert auth.check_key(KEY_B) == key_id(KEY_B, secret)
    with pytest.raises(AuthError):
        auth.check_key(KEY_A + "x")


def test_origin_policy() -> None:
    pol = OriginPolicy(["https://app.example.com"])
    host = "gw.example.com:8000"
    assert pol.allows(None, host)
    assert pol.allows("http://gw.example.com:8000", host)  # same origin
    assert pol.allows("http://localhost:5173", host)
    assert pol.allows("http://127.0.0.1:9", host)
    assert pol.allows("http://[::1]:3000", host)
    assert pol.allows("https://app.example.com/", host)
    assert not pol.allows("https://evil.example", host)
    assert not pol.allows("null", host)
    assert not pol.allows("http://gw.example.com:8001", host)
    assert OriginPolicy(["*"]).allows("https://evil.example", host)


# --- a gateway with keys ------------------------------------------------------------


@dataclass
class Secured:
    redis: EmbeddedRedis
    a: str
    b: str
    gw_a: Proc
    gw_b: Proc
    open: str  # a gateway with no keys


@pytest.fixture(scope="module")
def secured(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Secured]:
    logs = tmp_path_factory.mktemp("sec-logs")
    keys = logs / "keys.txt"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    worker_store = WorkerStore(redis_server.url, "sec-worker", prefix=PREFIX)
    worker_store.ensure_group()
    # no engine worker here: a stream left queued never ends, so drain for at most 1 s
    flags = ["--api-keys-file", str(keys), "--allow-origin", "https://app.example.com",
             "--rate-limit", "4", "--max-streams-per-key", "3", "--drain-timeout", "1",
             "--allowed-hosts", "chat.example.com,.corp.example"]  # fmt: skip
    gw_a, a = start_gateway(redis_server.url, PREFIX, logs, *flags)
    gw_b, b = start_gateway(redis_server.url, PREFIX, logs, *flags)
    per_address = ["--max-streams-per-address", "2", "--rate-limit-per-address", "3"]
    gw_o, o = start_gateway(redis_server.url, "secopen:", logs, *per_address)
    try:
        for addr, proc in ((a, gw_a), (b, gw_b), (o, gw_o)):
            wait_ready(addr, proc, 60, need_worker=False)
        worker_store.heartbeat(WorkerStats())
        yield Secured(redis_server, a, b, gw_a, gw_b, o)
    finally:
        stop_all([gw_a, gw_b, gw_o])
        redis_server.client().delete(f"{PREFIX}requests")
        worker_store.close()
    for proc in (gw_a, gw_b):
        text = proc.log_text()
        assert KEY_A not in text and KEY_B not in text, "an API key was logged"
        assert "token=v1." not in text, "a WebSocket token was logged"
        assert "token=[redacted]" in text  # uvicorn's "WebSocket /v1/ws?token=..." line
        assert "Traceback" not in text


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def open_refused(url: str, **kw: object) -> dict[str, object]:
    ws = await connect(url, open_timeout=10, **kw)  # type: ignore[arg-type]
    try:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 10)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1008
        return dict(frame)
    finally:
        await ws.close()


async def test_websocket_needs_a_key_or_token(secured: Secured) -> None:
    url = f"ws://{secured.a}/v1/ws"
    err = await open_refused(url)
    assert err["type"] == "error" and err["code"] == "unauthorized"
    err = await open_refused(url, additional_headers=bearer("sk-wrong-key-000"))
    assert err["code"] == "unauthorized"
    err = await open_refused(url + "?token=v1.abc.1.x.y")
    assert err["code"] == "unauthorized"
    c = await Client.open(secured.a, additional_headers=bearer(KEY_A))
    await c.send({"type": "ping"})
    assert await c.recv() == {"type": "pong"}
    await c.close()

    # browsers: trade the key for a short-lived token over HTTP
    resp = httpx.post(f"http://{secured.a}/v1/ws-token")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthorized"
    resp = httpx.post(f"http://{secured.a}/v1/ws-token", headers=bearer(KEY_B))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["auth_required"] is True and KEY_B not in body["token"]
    # any gateway with the same keys accepts it
    for addr in (secured.a, secured.b):
        async with connect(f"ws://{addr}/v1/ws?token={body['token']}") as ws:
            hello = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert hello["type"] == "hello"


async def test_http_api_needs_a_key(secured: Secured) -> None:
    base = f"http://{secured.a}"
    r = httpx.get(f"{base}/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{base}/v1/models", headers=bearer(KEY_A)).status_code == 200
    r = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Basic {KEY_A}"})
    assert r.status_code == 401


def test_host_policy() -> None:
    policy = HostPolicy(["chat.example.com", ".corp.example"], bind_host="0.0.0.0")
    for host in ("127.0.0.1:8000", "[::1]:8000", "10.0.0.7", "localhost:8000", "app.localhost",
                 "chat.example.com", "CHAT.example.com:443", "corp.example", "a.b.corp.example",
                 None):  # fmt: skip
        assert policy.allows(host), host
    for host in ("evil.example:8000", "chat.example.com.evil.example", "xcorp.example", ""):
        assert not policy.allows(host), host
    assert HostPolicy(["*"]).allows("anything.example")
    assert HostPolicy([], bind_host="gw.internal").allows("gw.internal:8000")


async def test_dns_rebinding_is_refused(secured: Secured) -> None:
    """A page whose name was re-pointed at the gateway is same-origin, but not a known host."""
    port = secured.open.rsplit(":", 1)[1]
    evil = f"rebind.example:{port}"
    headers = {"Host": evil, "Origin": f"http://{evil}"}
    for path in ("/", "/v1/models", "/healthz"):
        r = httpx.get(f"http://{secured.open}{path}", headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", path
        assert "--allowed-hosts" in r.json()["error"]["message"]
    ip = secured.open.rsplit(":", 1)[0]
    with pytest.raises(InvalidStatus) as info:  # the socket to the gateway, the name the page's
        await connect(f"ws://{evil}/v1/ws", host=ip, port=int(port), origin=f"http://{evil}",
                      open_timeout=10)  # type: ignore[arg-type]  # fmt: skip
    assert info.value.response.status_code == 403
    for host in (f"localhost:{port}", secured.open):  # by name on this machine, by address
        r = httpx.get(f"http://{secured.open}/v1/models", headers={"Host": host})
        assert r.status_code == 200, host
    # a gateway told its public names answers them, and only them
    port_a = secured.a.rsplit(":", 1)[1]
    for host, status in (("chat.example.com", 200), ("x.corp.example", 200), ("evil.example", 403)):
        named = {**bearer(KEY_A), "Host": f"{host}:{port_a}"}
        r = httpx.get(f"http://{secured.a}/v1/models", headers=named)
        assert r.status_code == status, host


async def test_origins_and_cors(secured: Secured) -> None:
    url = f"ws://{secured.a}/v1/ws"
    with pytest.raises(InvalidStatus) as info:
        await Client.open(secured.a, origin="https://evil.example",
                          additional_headers=bearer(KEY_A))  # fmt: skip
    assert info.value.response.status_code == 403
    for origin in ("https://app.example.com", "http://localhost:3000", f"http://{secured.a}"):
        c = await Client.open(secured.a, origin=origin, additional_headers=bearer(KEY_A))
        await c.close()
    assert url
    base = f"http://{secured.a}"
    pre = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    r = httpx.options(f"{base}/v1/chat/completions", headers=pre)
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "Authorization" in r.headers["access-control-allow-headers"]
    r = httpx.options(
        f"{base}/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"}
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = httpx.get(
        f"{base}/v1/models", headers={**bearer(KEY_A), "Origin": "https://app.example.com"}
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "X-Stream-Id" in r.headers["access-control-expose-headers"]
    r = httpx.get(f"{base}/v1/models", headers={**bearer(KEY_A), "Origin": "https://evil.example"})
    assert r.status_code == 403


async def test_rate_limit_is_shared_by_gateways(secured: Secured) -> None:
    """--rate-limit 4: the fifth request of a key within the minute is refused, on any gateway."""
    a = await Client.open(secured.a, additional_headers=bearer(KEY_B))
    b = await Client.open(secured.b, additional_headers=bearer(KEY_B))
    try:
        for i in range(2):
            await a.send({"type": "generate", "request_id": f"a{i}", "prompt": "hi"})
            await b.send({"type": "generate", "request_id": f"b{i}", "prompt": "hi"})
        await asyncio.sleep(0.5)
        await b.send({"type": "generate", "request_id": "b9", "prompt": "hi"})
        err = await b.recv(5)
        assert err["type"] == "error" and err["code"] == "rate_limited", err
        assert err["request_id"] == "b9" and err["retry_after"] >= 1
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(f"http://{secured.a}/v1/chat/completions", json=body, headers=bearer(KEY_B))
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert int(r.headers["retry-after"]) >= 1
    finally:
        await a.close()
        await b.close()


async def test_streams_per_key(secured: Secured) -> None:
    """--max-streams-per-key 3 (KEY_A has made no generate request yet in this module)."""
    c = await Client.open(secured.a, additional_headers=bearer(KEY_A))
    try:
        for i in range(4):
            await c.send({"type": "generate", "request_id": f"k{i}", "prompt": "hi"})
        err = await c.recv(5)
        assert err["code"] == "rate_limited" and err["request_id"] == "k3", err
        assert "per API key" in err["message"]
    finally:
        await c.close()
    await asyncio.sleep(0.3)
    c = await Client.open(secured.a, additional_headers=bearer(KEY_A))  # slots released
    await c.send({"type": "generate", "request_id": "again", "prompt": "hi"})
    await c.send({"type": "ping"})
    assert (await c.recv(5))["type"] == "pong"
    await c.close()


async def test_no_keys_means_open(secured: Secured) -> None:
    r = httpx.post(f"http://{secured.open}/v1/ws-token")
    assert r.json() == {"token": None, "expires_at": None, "auth_required": False}
    c = await Client.open(secured.open)
    await c.close()
    assert httpx.get(f"http://{secured.open}/v1/models").status_code == 200


async def test_without_keys_each_client_address_is_limited(secured: Secured) -> None:
    """--max-streams-per-address 2, --rate-limit-per-address 3 on the open gateway.

    Addresses come from X-Forwarded-For, believed from 127.0.0.1 (the default
    --forwarded-allow-ips); loopback itself is not counted.
    """

    async def generate(c: Client, rid: str) -> dict[str, object] | None:
        await c.send({"type": "generate", "request_id": rid, "prompt": "hi"})
        await c.send({"type": "ping"})
        frame = await c.recv(5)
        return None if frame["type"] in ("pong", "started") else frame

    worker_store = WorkerStore(secured.redis.url, "secopen-worker", prefix="secopen:")
    worker_store.ensure_group()
    worker_store.heartbeat(WorkerStats())  # a worker "is running"; the requests just stay queued
    far = {"X-Forwarded-For": "203.0.113.7"}
    c = await Client.open(secured.open, additional_headers=far)
    try:
        assert await generate(c, "a1") is None and await generate(c, "a2") is None
        err = await generate(c, "a3")
        assert err is not None and err["code"] == "rate_limited", err
        assert "per client address" in str(err["message"]) and err["request_id"] == "a3"
        other = await Client.open(
            secured.open, additional_headers={"X-Forwarded-For": "203.0.113.8"}
        )
        assert await generate(other, "b1") is None  # another address: its own slots
        await other.close()
    finally:
        await c.close()
    await asyncio.sleep(0.3)  # the closed socket's streams gave their slots back
    c = await Client.open(secured.open, additional_headers=far)
    try:
        assert await generate(c, "a4") is None  # the third request of this minute
        err = await generate(c, "a5")
        assert err is not None and err["code"] == "rate_limited", err
        assert "requests per minute" in str(err["message"])
    finally:
        await c.close()
    local = await Client.open(secured.open)  # this machine: not counted
    try:
        worker_store.heartbeat(WorkerStats())
        for i in range(5):
            assert await generate(local, f"l{i}") is None
    finally:
        await local.close()
        secured.redis.client().delete("secopen:requests")
        worker_store.close()
