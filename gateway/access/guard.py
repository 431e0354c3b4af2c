"""The gateway's front door: who is calling, from which page, and how much they may do.

One :class:`Guard` per gateway process (``gateway.app.Gateway.guard``) puts
together the pieces the WebSocket and the HTTP API both need:

- :class:`gateway.access.auth.Authenticator`: API keys and WebSocket tokens;
- :class:`gateway.access.cors.OriginPolicy`: allowed page origins;
- :class:`gateway.access.ratelimit.RateLimiter`: requests per minute per key (Redis);
- :class:`gateway.access.ratelimit.StreamSlots`: concurrent streams per key.

Without API keys, callers are told apart by address: a client off this machine
gets ``--max-streams-per-address`` concurrent streams here and
``--rate-limit-per-address`` requests per minute (Redis, across gateways), on by
default, so one client cannot fill the queue. Loopback addresses are not counted:
they are this machine's users, or a proxy whose forwarded addresses are not
trusted (``--forwarded-allow-ips``), which would make the limit one for everyone.

A resume is admitted like a new stream: a rate-limit token and a stream slot of its
caller (:meth:`Guard.resumer` over HTTP, the socket's or call's principal otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tokenrelay.core.exposure import is_loopback
from tokenrelay.gateway.access.auth import (
    Authenticator,
    Principal,
    SecuritySettings,
    install_log_redaction,
)
from tokenrelay.gateway.access.cors import OriginPolicy
from tokenrelay.gateway.access.ratelimit import Draw, RateLimiter, StreamSlots
from tokenrelay.gateway.errors import AuthError, RateLimited, TooManyStreams

log = logging.getLogger("tokenrelay.guard")

__all__ = ["AuthError", "Guard", "Principal", "RateLimited", "TooManyStreams"]


class Guard:
    """Authentication, origin policy and per-key limits of one gateway."""

    def __init__(self, settings: SecuritySettings, draw: Draw) -> None:
        self.settings = settings
        self.auth = Authenticator(
            settings.api_keys, token_ttl=settings.ws_token_ttl, id_secret=settings.key_id_secret
        )
        self.origins = OriginPolicy(settings.allow_origins)
        self.rate = RateLimiter(draw, settings.rate_limit, settings.rate_burst)
        self.slots = StreamSlots(settings.max_streams_per_key)
        self.address_rate = RateLimiter(draw, settings.rate_limit_per_address)
        self.address_slots = StreamSlots(settings.max_streams_per_address)
        install_log_redaction()

    @staticmethod
    def by_address(who: Principal) -> bool:
        """Whether the per-address limits apply: no keys, a known address off this host."""
        return who.key_id is None and who.address != "?" and not is_loopback(who.address)

    def authenticate(
        self, headers: Mapping[str, str], query: Mapping[str, str], address: str = "?"
    ) -> Principal:
        """The caller; raises :class:`AuthError` (logged without the key)."""
        try:
            return self.auth.authenticate(headers, query, address)
        except AuthError as exc:
            log.info("authentication failed", extra={"reason": str(exc), "client": address})
            raise

    def resumer(self, headers: Mapping[str, str], address: str = "?") -> Principal:
        """Who resumes a stream over HTTP: the key it sends (checked), else its address.

        The stream's resume token authorises the resume (a browser ``EventSource``
        cannot send a key); the key, when one is sent, names the limits it counts
        against. A wrong key raises :class:`AuthError`.
        """
        if not headers.get("authorization"):
            return Principal(None, address)
        return self.authenticate(headers, {}, address)

    async def admit(self, who: Principal, cost: int = 1) -> None:
        """Count a request (``cost``: its streams, HTTP's ``n``) against the caller's rate;
        raises :class:`RateLimited`."""
        await self.rate.check(who.bucket, cost)
        if self.by_address(who):  # a bucket of its own: not drawn from twice per request
            await self.address_rate.check(f"{who.bucket}:per-address", cost)

    def log_owner(self, who: Principal) -> str | None:
        """Whose ledger counts the bytes of the caller's stream logs in Redis
        (``--max-log-bytes-per-key``): its key, else its address off this host, as the other
        per-key limits; ``None``: not counted."""
        return who.bucket if who.key_id is not None or self.by_address(who) else None

    def open_stream(self, who: Principal) -> str:
        """Take a stream slot for the caller; returns the bucket to release later.

        Keys count against ``--max-streams-per-key``; without keys, addresses off this
        host against ``--max-streams-per-address`` (0: off).
        """
        if who.key_id is None:
            if not self.by_address(who) or self.address_slots.limit <= 0:
                return ""
            if not self.address_slots.acquire(who.bucket):
                limit = self.address_slots.limit
                raise TooManyStreams(f"at most {limit} concurrent streams per client address")
            return who.bucket
        if not self.slots.acquire(who.bucket):
            limit = self.slots.limit
            raise TooManyStreams(f"at most {limit} concurrent streams per API key")
        return who.bucket

    def close_stream(self, bucket: str) -> None:
        if bucket.startswith("addr:"):
            self.address_slots.release(bucket)
        elif bucket:
            self.slots.release(bucket)
