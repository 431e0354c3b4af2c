"""API keys, short-lived WebSocket tokens and the security settings of a gateway.

Keys come from ``--api-keys`` / ``TOKENRELAY_API_KEYS`` (comma-separated) and
``--api-keys-file`` / ``TOKENRELAY_API_KEYS_FILE`` (one key per line, ``#``
comments). With no key configured, nothing needs authentication.

A caller proves a key with ``Authorization: Bearer <key>`` (HTTP and the
WebSocket handshake) or, where a browser cannot set headers on a WebSocket,
with a token from ``POST /v1/ws-token`` passed as ``/v1/ws?token=...``. A
token is ``v1.<key id>.<expiry>.<nonce>.<HMAC-SHA256>``: it names the key by a
hash (never the key), expires after ``--ws-token-ttl`` seconds, and is signed
with a secret derived from the configured keys, so every gateway with the same
keys accepts every other's tokens and removing a key voids its tokens.

Keys are never logged: log lines, rate-limit buckets in Redis and tokens carry the key id
(:attr:`Principal.key_id`), an HMAC-SHA256 of the key with a secret of the deployment, so
that whoever reads the logs or Redis cannot test guesses of a key offline. The secret is
``--key-id-secret`` / ``TOKENRELAY_KEY_ID_SECRET`` (the same on every gateway), else one
derived from all the configured keys: a guess is then tested only by someone who holds
every key, and the ids change when a key is added or removed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote_plus

from tokenrelay.core import options
from tokenrelay.core.redis.embedded import parse_memory
from tokenrelay.core.wire.log_ledger import DEFAULT_MAX_LOG_BYTES
from tokenrelay.core.wire.requests import DEFAULT_MAX_OUTPUT_ENTRIES, DEFAULT_MAX_TOKENS_LIMIT
from tokenrelay.gateway.errors import AuthError

TOKEN_VERSION = "v1"
_TOKEN_LABEL = b"tokenrelay ws-token v1"
_KEY_ID_LABEL = b"tokenrelay key-id v1"
MIN_KEY_ID_SECRET = 16  # characters of --key-id-secret


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: a key id (:func:`key_id`) or an address."""

    key_id: str | None  # None: no keys configured
    address: str = "?"

    @property
    def bucket(self) -> str:
        """The name limits count under: the key when there is one, else the address."""
        return f"key:{self.key_id}" if self.key_id else f"addr:{self.address}"


def key_id(key: str, secret: bytes) -> str:
    """A key's name in logs, Redis and tokens: 16 hex digits of HMAC-SHA256(``secret``, key).

    Without ``secret`` nobody can tell whether a guessed key has a given id."""
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:16]


def key_id_secret(keys: Iterable[str], configured: str | None = None) -> bytes:
    """The secret of :func:`key_id`: ``configured`` (``--key-id-secret``), else derived
    from every one of ``keys``."""
    if configured:
        return configured.encode()
    material = b"\n".join(sorted(k.encode() for k in keys))
    return hmac.new(material, _KEY_ID_LABEL, hashlib.sha256).digest()


def read_keys_file(path: str | os.PathLike[str]) -> list[str]:
    """Keys from a file: one per line; blank lines and ``#`` comments are skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def load_keys(inline: str | None, path: str | None) -> tuple[str, ...]:
    """The configured keys (comma-separated ``inline`` plus the file), de-duplicated."""
    keys = [k.strip() for k in (inline or "").split(",") if k.strip()]
    if path:
        try:
            keys += read_keys_file(path)
        except OSError as exc:
            raise ValueError(f"--api-keys-file {path}: {exc.strerror or exc}") from None
    for k in keys:
        if any(c.isspace() or not c.isprintable() for c in k):
            raise ValueError("API keys must be printable, with no whitespace")
    return tuple(dict.fromkeys(keys))


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class Authenticator:
    """Checks bearer keys and WebSocket tokens against the configured keys."""

    def __init__(
        self, keys: Iterable[str], *, token_ttl: float = 60.0, id_secret: str | None = None
    ) -> None:
        keys = tuple(keys)
        secret = key_id_secret(keys, id_secret)
        self._keys = {key_id(k, secret): k.encode() for k in keys}
        self.token_ttl = token_ttl
        material = b"\n".join(sorted(self._keys.values()))
        self._secret = hmac.new(material, _TOKEN_LABEL, hashlib.sha256).digest()

    @property
    def enabled(self) -> bool:
        """True when keys are configured (and so required)."""
        return bool(self._keys)

    def check_key(self, given: str) -> str:
        """The key id of ``given``, compared in constant time; else :class:`AuthError`."""
        found = None
        raw = given.encode("utf-8", "surrogatepass")
        for kid, key in self._keys.items():  # no early exit: time does not depend on which
            if hmac.compare_digest(raw, key):
                found = kid
        if found is None:
            raise AuthError("Incorrect API key provided.")
        return found

    def issue_token(self, kid: str, *, now: float | None = None) -> tuple[str, int]:
        """A signed WebSocket token for key ``kid`` and its expiry (unix seconds)."""
        expires = int((now if now is not None else time.time()) + self.token_ttl)
        payload = f"{TOKEN_VERSION}.{kid}.{expires}.{secrets.token_urlsafe(9)}"
        return f"{payload}.{self._sign(payload)}", expires

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._secret, payload.encode(), hashlib.sha256).digest())

    def check_token(self, token: str, *, now: float | None = None) -> str:
        """The key id a token was issued for; :class:`AuthError` when forged or expired."""
        parts = token.split(".")
        if len(parts) != 5 or parts[0] != TOKEN_VERSION or not parts[2].isdigit():
            raise AuthError("malformed token")
        payload, sig = ".".join(parts[:4]), parts[4]
        if not hmac.compare_digest(sig.encode(), self._sign(payload).encode()):
            raise AuthError("invalid token")
        if int(parts[2]) < (now if now is not None else time.time()):
            raise AuthError("token expired: fetch a new one from POST /v1/ws-token")
        if parts[1] not in self._keys:
            raise AuthError("the token's key has been revoked")
        return parts[1]

    def authenticate(
        self, headers: Mapping[str, str], query: Mapping[str, str], address: str = "?"
    ) -> Principal:
        """The caller of a request: bearer key, else ``?token=`` (WebSocket only)."""
        if not self.enabled:
            return Principal(None, address)
        auth = headers.get("authorization", "")
        if auth:
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not given.strip():
                raise AuthError("Authorization must be 'Bearer <key>'.")
            return Principal(self.check_key(given.strip()), address)
        token = query.get("token")
        if token:
            return Principal(self.check_token(token), address)
        raise AuthError("Missing API key: send 'Authorization: Bearer <key>'.")


_QUERY_PARAM = re.compile(r"([?&])([^=&\s\"'#?]*)=([^&\s\"']*)")
SECRET_PARAMS = frozenset({"token", "resume_token"})  # query parameters that hold a secret


def _redact_param(match: re.Match[str]) -> str:
    if unquote_plus(match.group(2)).lower() not in SECRET_PARAMS:
        return match.group()
    return f"{match.group(1)}{match.group(2)}=[redacted]"


def redact_query(text: str) -> str:
    """``text`` with the value of every ``token`` / ``resume_token`` query parameter
    replaced by ``[redacted]``, however the name is spelled (``resume%5Ftoken`` is the
    same parameter to the gateway)."""
    return _QUERY_PARAM.sub(_redact_param, text) if "=" in text else text


class RedactSecrets(logging.Filter):
    """Hides ``?token=`` and ``?resume_token=`` values in log lines (uvicorn's access log and
    its WebSocket lines carry the request's query)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(redact_query(a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


def install_log_redaction() -> None:
    """Put :class:`RedactSecrets` on uvicorn's loggers (idempotent)."""
    for name in ("uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())


def log_bytes_limit(raw: str | int | None) -> int:
    """``--max-log-bytes-per-key`` in bytes (the default when ``None``); a clear
    ``ValueError`` for anything but a Redis memory size."""
    try:
        return parse_memory(DEFAULT_MAX_LOG_BYTES if raw is None else raw)
    except ValueError as exc:
        raise ValueError(f"--max-log-bytes-per-key: {exc}") from None


@dataclass(frozen=True)
class SecuritySettings:
    """Auth, origins and per-key limits (``tokenrelay gateway`` / ``serve`` flags)."""

    api_keys: tuple[str, ...] = ()
    ws_token_ttl: float = options.WS_TOKEN_TTL
    allow_origins: tuple[str, ...] = ()
    rate_limit: float = 0.0  # requests per minute per key (0: off)
    rate_burst: int = 0  # bucket size (0: same as rate_limit)
    max_streams_per_key: int = options.MAX_STREAMS_PER_KEY
    max_tokens: int = DEFAULT_MAX_TOKENS_LIMIT
    max_output_entries: int = DEFAULT_MAX_OUTPUT_ENTRIES
    max_log_bytes: int = parse_memory(DEFAULT_MAX_LOG_BYTES)  # per key (address); 0: none
    max_streams_per_address: int = options.MAX_STREAMS_PER_ADDRESS  # without keys; 0: off
    rate_limit_per_address: float = options.RATE_LIMIT_PER_ADDRESS  # per minute; 0: off
    allowed_hosts: tuple[str, ...] = ()  # Host names answered besides addresses, localhost
    bind_host: str | None = None  # --host: the address this gateway was told to listen on
    key_id_secret: str | None = None  # --key-id-secret; None: derived from the keys

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SecuritySettings:
        keys = load_keys(getattr(args, "api_keys", None), getattr(args, "api_keys_file", None))
        origins: list[str] = []
        for item in getattr(args, "allow_origin", None) or []:
            origins += [o.strip().rstrip("/") for o in item.split(",") if o.strip()]
        hosts = [h.strip() for h in (getattr(args, "allowed_hosts", None) or "").split(",")]
        out = cls(
            api_keys=keys,
            ws_token_ttl=getattr(args, "ws_token_ttl", options.WS_TOKEN_TTL),
            allow_origins=tuple(origins),
            rate_limit=getattr(args, "rate_limit", 0.0),
            rate_burst=getattr(args, "rate_limit_burst", 0),
            max_streams_per_key=getattr(args, "max_streams_per_key", options.MAX_STREAMS_PER_KEY),
            max_tokens=getattr(args, "max_tokens_limit", DEFAULT_MAX_TOKENS_LIMIT),
            max_output_entries=getattr(args, "max_output_entries", DEFAULT_MAX_OUTPUT_ENTRIES),
            max_log_bytes=log_bytes_limit(getattr(args, "max_log_bytes_per_key", None)),
            max_streams_per_address=getattr(
                args, "max_streams_per_address", options.MAX_STREAMS_PER_ADDRESS
            ),
            rate_limit_per_address=getattr(
                args, "rate_limit_per_address", options.RATE_LIMIT_PER_ADDRESS
            ),
            allowed_hosts=tuple(h for h in hosts if h),
            bind_host=getattr(args, "host", None),
            key_id_secret=getattr(args, "key_id_secret", None) or None,
        )
        out.validate()
        return out

    def validate(self) -> None:
        if not 1 <= self.ws_token_ttl <= 86400:
            raise ValueError("--ws-token-ttl must be between 1 and 86400 seconds")
        if self.rate_limit < 0 or self.rate_burst < 0 or self.max_streams_per_key < 1:
            raise ValueError("--rate-limit/--rate-limit-burst >= 0, --max-streams-per-key >= 1")
        if self.max_streams_per_address < 0 or self.rate_limit_per_address < 0:
            raise ValueError("--max-streams-per-address and --rate-limit-per-address are >= 0")
        if self.max_tokens < 1:
            raise ValueError("--max-tokens-limit must be >= 1")
        if self.max_output_entries < self.max_tokens:
            raise ValueError("--max-output-entries must be at least --max-tokens-limit")
        secret = self.key_id_secret
        if secret is not None and (len(secret) < MIN_KEY_ID_SECRET or not secret.isprintable()):
            raise ValueError(
                f"--key-id-secret must be at least {MIN_KEY_ID_SECRET} printable characters "
                f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )

    def __repr__(self) -> str:  # never print the keys
        return f"SecuritySettings(keys={len(self.api_keys)}, origins={self.allow_origins!r})"
