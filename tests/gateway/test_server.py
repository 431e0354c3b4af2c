"""The uvicorn server the gateway builds: which proxies' forwarded headers it believes."""

from __future__ import annotations

import pytest

from tokenrelay.core.cli import build_parser
from tokenrelay.gateway.server import build_server
from tokenrelay.gateway.state import Settings


@pytest.mark.parametrize(
    ("flags", "trusted"),
    [
        ([], ["127.0.0.1"]),  # a proxy on the same host, the default
        (["--forwarded-allow-ips", "10.0.0.0/8,192.168.1.5"], ["10.0.0.0/8", "192.168.1.5"]),
        (["--forwarded-allow-ips", "*"], ["*"]),
    ],
)
def test_forwarded_headers_are_believed_only_from_the_listed_proxies(
    flags: list[str], trusted: list[str]
) -> None:
    args = build_parser().parse_args(["gateway", "--redis-url", "redis://127.0.0.1:1/0", *flags])
    server = build_server(
        Settings.from_args(args), "127.0.0.1", 0, forwarded_allow_ips=args.forwarded_allow_ips
    )
    assert server.config.proxy_headers
    assert server.config.forwarded_allow_ips in (trusted, ",".join(trusted))
