"""Key ids (gateway/access/auth.py): an HMAC of the key with the deployment's secret, so the
ids in logs and Redis do not let anyone test a guessed key offline."""

from __future__ import annotations

import hashlib
import logging

import pytest

from tokenrelay.core.cli import build_parser
from tokenrelay.core.redis.embedded import EmbeddedRedis
from tokenrelay.gateway.access.auth import (
    Authenticator,
    SecuritySettings,
    key_id,
    key_id_secret,
)
from tokenrelay.gateway.access.guard import Guard
from tokenrelay.gateway.errors import AuthError
from tokenrelay.gateway.streams.store import StreamStore

KEY_A = "sk-key-ids-a-0123456789abcdef"
KEY_B = "sk-key-ids-b-0123456789abcdef"
SECRET = "a-deployment-secret-0123456789"


def plain_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def test_a_key_id_needs_the_secret() -> None:
    secret = SECRET.encode()
    kid = key_id(KEY_A, secret)
    assert len(kid) == 16 and int(kid, 16) >= 0
    assert kid != plain_hash(KEY_A)  # a guess of the key alone gives nothing to compare
    assert kid != key_id(KEY_A, b"another-secret-0123456789")
    assert key_id(KEY_A, secret) == kid  # stable: buckets and tokens find it again


def test_gateways_with_one_secret_agree_and_keep_ids_when_keys_change() -> None:
    one = Authenticator([KEY_A, KEY_B], id_secret=SECRET)
    other = Authenticator([KEY_B, KEY_A], id_secret=SECRET)
    assert one.check_key(KEY_A) == other.check_key(KEY_A) == key_id(KEY_A, SECRET.encode())
    token, _ = one.issue_token(one.check_key(KEY_A))
    assert other.check_token(token) == one.check_key(KEY_A)  # any gateway takes its tokens
    assert Authenticator([KEY_A], id_secret=SECRET).check_key(KEY_A) == one.check_key(KEY_A)


def test_without_a_secret_the_ids_derive_from_every_key() -> None:
    both = Authenticator([KEY_A, KEY_B])
    assert both.check_key(KEY_A) == key_id(KEY_A, key_id_secret([KEY_B, KEY_A]))
    assert both.check_key(KEY_A) != plain_hash(KEY_A)
    assert Authenticator([KEY_A]).check_key(KEY_A) != both.check_key(KEY_A)  # a new key set


async def test_redis_and_logs_hold_the_hmac_not_a_plain_hash(
    redis_server: EmbeddedRedis, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = SecuritySettings(api_keys=(KEY_A,), rate_limit=60.0, key_id_secret=SECRET)
    store = StreamStore(redis_server.url, prefix=prefix)
    await store.start()
    try:
        guard = Guard(settings, store.draw_tokens)
        who = guard.authenticate({"authorization": f"Bearer {KEY_A}"}, {}, "203.0.113.7")
        await guard.admit(who)  # a rate-limit bucket in Redis, named by the key id
        with (
            caplog.at_level(logging.INFO, logger="tokenrelay.guard"),
            pytest.raises(AuthError, match="Incorrect API key"),
        ):
            guard.authenticate({"authorization": "Bearer wrong"}, {}, "203.0.113.7")
    finally:
        await store.close()
    names = [k.decode() for k in redis_server.client().keys(f"{prefix}*")]
    assert any(key_id(KEY_A, SECRET.encode()) in n for n in names), names
    assert not any(plain_hash(KEY_A) in n for n in names), names
    assert who.key_id == key_id(KEY_A, SECRET.encode())
    assert KEY_A not in caplog.text and plain_hash(KEY_A) not in caplog.text


def test_the_secret_comes_from_its_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENRELAY_KEY_ID_SECRET", SECRET)
    for command in ("serve", "gateway"):
        args = build_parser().parse_args([command, "--redis-url", "redis://x"])
        settings = SecuritySettings.from_args(args)
        assert settings.key_id_secret == SECRET and SECRET not in repr(settings), command
    with pytest.raises(ValueError, match="--key-id-secret must be at least 16"):
        SecuritySettings(key_id_secret="short").validate()
