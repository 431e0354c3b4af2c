"""Graceful shutdown of a gateway: stop taking requests, let running streams finish.

On SIGTERM (or Ctrl+C) gateway/server.py calls :func:`drain` before uvicorn's
own shutdown. While it drains, the gateway still accepts connections so that
load balancers and clients get clear answers rather than refused connections:

- ``/readyz`` answers 503, so a load balancer takes the gateway out;
- a new ``generate`` (WebSocket) or completion request (HTTP) is refused with
  ``unavailable`` (HTTP 503 with ``Retry-After``); a new WebSocket is closed
  with 1001 at once;
- every open WebSocket gets ``{"type":"notice","code":"shutting_down",
  "drain_s":N}``, and the streams clients are attached to keep flowing until
  they end or ``--drain-timeout`` seconds pass.

Then the sockets are closed with 1001 (a client resumes any unfinished stream
on another gateway: its worker keeps generating for the detach timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tokenrelay.gateway.streams.store import StreamStore

log = logging.getLogger("tokenrelay.drain")

POLL_S = 0.05
NOTICE_SEND_TIMEOUT = 1.0  # a client whose send queue stays full does not hold up the drain


def notice_frame(code: str, message: str, **fields: Any) -> dict[str, Any]:
    """A ``notice`` frame: information for the client, not an error (docs/protocol.md)."""
    return {"type": "notice", "code": code, "message": message, **fields}


class ClientSocket(Protocol):
    """An open client socket, as the drain and the readiness watch see it (a WebSocket)."""

    waiting_for_worker: bool  # its hello said no worker was ready

    async def send(self, frame: dict[str, Any]) -> None:
        """Queue one frame for the client."""
        ...

    def close(self, code: int, reason: str = "") -> None:
        """Close the socket with ``code`` (its pending frames are sent first)."""
        ...


def running_streams(streams: StreamStore) -> int:
    """Unfinished streams a client of this gateway is attached to (WebSocket or HTTP)."""
    return len(streams.attachments.tracked)


async def drain(
    streams: StreamStore,
    sockets: Collection[ClientSocket],
    timeout: float,
    *,
    force: Callable[[], bool] = lambda: False,
) -> bool:
    """Stop taking requests and wait up to ``timeout`` s for attached streams to end.

    Returns True when every stream ended in time. ``force`` is polled: when
    it returns True (a second Ctrl+C) the wait stops at once.
    """
    streams.accepting = False
    started = time.monotonic()
    left = running_streams(streams)
    log.info("draining", extra={"streams": left, "drain_timeout": timeout})
    frame = notice_frame(
        "shutting_down",
        "the gateway is shutting down: running streams may finish; start new ones elsewhere",
        drain_s=math.ceil(timeout),
    )
    sends = [_notify(conn.send(frame)) for conn in list(sockets)]
    await asyncio.gather(*sends)
    deadline = started + max(0.0, timeout)
    while running_streams(streams) and time.monotonic() < deadline and not force():
        await asyncio.sleep(POLL_S)
    left = running_streams(streams)
    extra = {"streams_left": left, "seconds": round(time.monotonic() - started, 3)}
    if left:
        log.warning("drain timeout: closing sockets with streams still running", extra=extra)
    else:
        log.info("drained", extra=extra)
    return left == 0


async def _notify(send: Any) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(send, NOTICE_SEND_TIMEOUT)
