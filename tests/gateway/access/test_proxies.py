"""gateway/access/proxies.py: ``--forwarded-allow-ips`` as uvicorn reads it for HTTP, for gRPC."""

from __future__ import annotations

import pytest
from uvicorn.middleware.proxy_headers import _TrustedHosts

from tokenrelay.gateway.access.proxies import TrustedProxies
from tokenrelay.gateway.state import Settings

ALLOW = ["127.0.0.1", "*", "10.0.0.0/8, 192.168.1.5", "::1, fd00::/8", "127.0.0.1,10.1.2.3"]
FORWARDED = [
    ["203.0.113.7"],
    ["203.0.113.7, 127.0.0.1"],
    ["203.0.113.7, 10.1.2.3"],
    ["127.0.0.1"],
    ["10.1.2.3, 10.4.5.6"],
    ["203.0.113.7:4321"],
    ["[2001:db8::1]:443, ::1"],
    ["198.51.100.1", "203.0.113.7"],  # two headers: read as one list
    ["unknown, 10.1.2.3"],
    [""],
    [" , 10.1.2.3"],
]
PEERS = ["127.0.0.1", "10.1.2.3", "192.168.1.5", "::1", "203.0.113.9"]


@pytest.mark.parametrize("allow", ALLOW)
def test_the_client_address_is_the_one_uvicorn_gives_http(allow: str) -> None:
    ours, theirs = TrustedProxies(allow), _TrustedHosts(allow)
    for peer in PEERS:
        for forwarded in FORWARDED:
            expected = peer
            if peer in theirs:
                host, _ = theirs.get_trusted_client_address(", ".join(forwarded))
                expected = host or peer
            assert ours.client(peer, forwarded) == expected, (allow, peer, forwarded)
        assert ours.client(peer, []) == peer


def test_a_client_cannot_pass_for_loopback_through_an_untrusted_peer() -> None:
    proxies = TrustedProxies("192.0.2.1")
    assert proxies.client("203.0.113.7", ["127.0.0.1"]) == "203.0.113.7"
    assert proxies.client("192.0.2.1", ["127.0.0.1, 203.0.113.7"]) == "203.0.113.7"


@pytest.mark.parametrize("bad", ["proxy.example", "10.0.0.1/8", "127.0.0.1,*", "300.1.1.1"])
def test_a_bad_entry_stops_the_settings(bad: str) -> None:
    with pytest.raises(ValueError, match="--forwarded-allow-ips"):
        Settings(redis_url="redis://localhost", forwarded_allow_ips=bad)
