"""Which client a connection stands for: the proxies of ``--forwarded-allow-ips``.

A connection from a trusted proxy stands for the address its ``X-Forwarded-For`` names;
any other connection for its own peer address. The per-address limits, the loopback
exemption and the log lines all use that address, so a client that sends
``X-Forwarded-For: 127.0.0.1`` itself is still counted as what it is.

uvicorn applies this rule to HTTP requests and WebSocket handshakes
(``proxy_headers=True``, gateway/server.py); :class:`TrustedProxies` applies the same rule
to gRPC calls (their ``x-forwarded-for`` metadata), and checks the flag once at start:

- ``*`` alone trusts every peer, and the first (leftmost) forwarded address is the client;
- otherwise a comma list of addresses and networks (``10.0.0.0/8``); the client is the
  last forwarded address that is not a trusted proxy (each proxy appends the address it
  got the connection from), or the first one when all of them are trusted.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _host(item: str) -> str:
    """The host of one forwarded entry, without a port (``1.2.3.4:5``, ``[::1]:5``)."""
    if item.startswith("["):
        host, sep, rest = item[1:].partition("]")
        return host if sep and (not rest or rest.startswith(":")) else item
    if item.count(":") == 1:
        host, _, port = item.partition(":")
        return host if port.isdigit() else item
    return item


class TrustedProxies:
    """The parsed ``--forwarded-allow-ips``; raises ``ValueError`` for an entry that is
    neither an address, a network nor ``*`` alone."""

    def __init__(self, allow: str) -> None:
        items = [item.strip() for item in allow.split(",") if item.strip()]
        self.any = items == ["*"]
        self.addresses: frozenset[Address] = frozenset()
        self.networks: tuple[Network, ...] = ()
        if self.any:
            return
        addresses: set[Address] = set()
        networks: list[Network] = []
        for item in items:
            try:
                if "/" in item:
                    networks.append(ipaddress.ip_network(item))
                else:
                    addresses.add(ipaddress.ip_address(item))
            except ValueError as exc:
                raise ValueError(
                    f"--forwarded-allow-ips: {item!r} is not an IP address, a network such "
                    f"as 10.0.0.0/8, or '*' alone ({exc})"
                ) from None
        self.addresses, self.networks = frozenset(addresses), tuple(networks)

    def trusts(self, host: str) -> bool:
        """Whether ``host`` (an address as text) is one of the trusted proxies."""
        if self.any:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return ip in self.addresses or any(ip in net for net in self.networks)

    def client(self, peer: str, forwarded_for: Sequence[str]) -> str:
        """The client's address: ``peer``, or from ``forwarded_for`` (the values of every
        ``x-forwarded-for`` header, in order) when ``peer`` is a trusted proxy."""
        if not forwarded_for or not self.trusts(peer):
            return peer
        hosts = [_host(item.strip()) for item in ", ".join(forwarded_for).split(",")]
        if not self.any:
            for host in reversed(hosts):
                if not self.trusts(host):
                    return host or peer
        return hosts[0] or peer
