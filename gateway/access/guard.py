"""The gateway's front door: who is calling, from which page, and how much they may do.

One :class:`Guard` per gateway process (``gateway.app.Gateway.guard``) puts
together the pieces the WebSocket and the HTTP API both need:

- :class:`gateway.access.auth.Authenticator`: API keys and WebSocket tokens;
- :class:`gateway.access.cors.OriginPolicy`: allowed page origins;
- :class:`gateway.access.ratelimit.RateLimiter`: requests per minute per key (Redis);
- :class:`gateway.access.ratelimit.StreamSlots`: concurrent streams per key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import redis.asyncio as aioredis

from gateway.access.auth import (
    Authenticator,
    AuthError,
    Principal,
    SecuritySettings,
    install_log_redaction,
)
from gateway.access.cors import OriginPolicy
from gateway.access.ratelimit import RateLimited, RateLimiter, StreamSlots

log = logging.getLogger("tokenrelay.guard")

__all__ = ["AuthError", "Guard", "Principal", "RateLimited", "TooManyStreams"]


class TooManyStreams(Exception):
    """The key already has ``--max-streams-per-key`` streams open here."""


class Guard:
    """Authentication, origin policy and per-key limits of one gateway."""

    def __init__(self, settings: SecuritySettings, redis: aioredis.Redis, prefix: str) -> None:
        self.settings = settings
        self.auth = Authenticator(settings.api_keys, token_ttl=settings.ws_token_ttl)
        self.origins = OriginPolicy(settings.allow_origins)
        self.rate = RateLimiter(redis, prefix, settings.rate_limit, settings.rate_burst)
        self.slots = StreamSlots(settings.max_streams_per_key)
        install_log_redaction()

    def authenticate(
        self, headers: Mapping[str, str], query: Mapping[str, str], address: str = "?"
    ) -> Principal:
        """The caller; raises :class:`AuthError` (logged without the key)."""
        try:
            return self.auth.authenticate(headers, query, address)
        except AuthError as exc:
            log.info("authentication failed", extra={"reason": str(exc), "client": address})
            raise

    async def admit(self, who: Principal) -> None:
        """Count one request against the caller's rate; raises :class:`RateLimited`."""
        await self.rate.check(who.bucket)

    def open_stream(self, who: Principal) -> str:
        """Take a stream slot for the caller; returns the bucket to release later.

        Only API keys are counted: without keys every browser behind one proxy would
        share an address (the per-connection and queue limits still hold).
        """
        if who.key_id is None:
            return ""
        if not self.slots.acquire(who.bucket):
            limit = self.slots.limit
            raise TooManyStreams(f"at most {limit} concurrent streams per API key")
        return who.bucket

    def close_stream(self, bucket: str) -> None:
        if bucket:
            self.slots.release(bucket)
