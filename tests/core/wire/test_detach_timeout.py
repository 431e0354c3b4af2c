"""A request's ``detach_timeout``: one check (core/wire/requests.py) for every transport,
capped by ``--max-detach-timeout``, kept out of the worker's body (it goes into the
request record), and the gateway's flag, its settings check and its hello."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import pytest

from tokenrelay.core import options
from tokenrelay.core.wire.errors import RequestError
from tokenrelay.core.wire.requests import (
    DEFAULT_MAX_DETACH_TIMEOUT,
    Limits,
    validate_detach_timeout,
)
from tokenrelay.gateway.http.openai_request import ApiError, parse_chat, parse_completion
from tokenrelay.gateway.session import protocol as p
from tokenrelay.gateway.state import Settings

LIMITS = Limits()
TIGHT = dataclasses.replace(LIMITS, max_detach_timeout=120.0)
MSGS = [{"role": "user", "content": "Hi"}]


def refusal(value: Any, limits: Limits = LIMITS) -> RequestError:
    with pytest.raises(RequestError) as info:
        validate_detach_timeout(value, limits)
    return info.value


def generate(params: dict[str, Any], limits: Limits = LIMITS) -> p.Generate:
    frame = {"type": "generate", "request_id": "r1", "prompt": "Hi", "params": params}
    parsed = p.parse_frame(json.dumps(frame), limits)
    assert isinstance(parsed, p.Generate)
    return parsed


def test_the_default_cap_is_ten_minutes() -> None:
    assert DEFAULT_MAX_DETACH_TIMEOUT == 600.0 == LIMITS.max_detach_timeout
    assert options.MAX_DETACH_TIMEOUT == DEFAULT_MAX_DETACH_TIMEOUT >= options.DETACH_TIMEOUT


@pytest.mark.parametrize(("value", "seconds"), [(300, 300.0), (0.5, 0.5), (600, 600.0)])
def test_seconds_up_to_the_cap_are_accepted(value: Any, seconds: float) -> None:
    got = validate_detach_timeout(value, LIMITS)
    assert got == seconds and isinstance(got, float)


def test_left_out_is_none_the_gateways_default() -> None:
    assert validate_detach_timeout(None, LIMITS) is None


def test_over_the_cap_is_a_bad_request_naming_the_limit() -> None:
    err = refusal(600.5)
    assert err.code == "bad_request" and err.field == "detach_timeout"
    assert err.message == (
        "detach_timeout must be above 0 and at most 600 seconds (--max-detach-timeout), got 600.5"
    )
    assert "at most 120 seconds" in refusal(121, TIGHT).message
    assert validate_detach_timeout(120, TIGHT) == 120.0


@pytest.mark.parametrize("value", [0, 0.0, -1, -0.001])
def test_zero_or_less_is_a_bad_request(value: Any) -> None:
    err = refusal(value)
    assert err.code == "bad_request" and err.field == "detach_timeout"
    assert "above 0" in err.message


@pytest.mark.parametrize(
    ("value", "got"), [("300", "str"), (True, "a boolean"), ([300], "list"), ({}, "dict")]
)
def test_a_non_number_is_a_bad_request(value: Any, got: str) -> None:
    err = refusal(value)
    assert err.code == "bad_request" and err.field == "detach_timeout"
    assert err.message == f"detach_timeout must be a number, got {got}"


def test_nan_and_infinity_are_refused() -> None:
    for value in (float("nan"), float("inf")):
        assert refusal(value).code == "bad_request"


# --- the transports ---------------------------------------------------------------


def test_websocket_params_carry_it_beside_the_sampling_params() -> None:
    g = generate({"max_tokens": 8, "detach_timeout": 300})
    assert g.detach_timeout == 300.0
    assert "detach_timeout" not in g.body()["params"]  # the worker's body: sampling only
    assert generate({"max_tokens": 8}).detach_timeout is None
    assert generate({"detach_timeout": None}).detach_timeout is None


@pytest.mark.parametrize(
    ("value", "words"), [(601, "at most 600 seconds"), (0, "above 0"), ("5", "must be a number")]
)
def test_websocket_refusals_carry_the_request_id(value: Any, words: str) -> None:
    with pytest.raises(p.ProtocolError) as info:
        generate({"detach_timeout": value})
    assert info.value.code == "bad_request" and info.value.request_id == "r1"
    assert words in info.value.message
    with pytest.raises(p.ProtocolError):
        generate({"detach_timeout": 121}, TIGHT)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_http_takes_it_as_an_extension_field(kind: str) -> None:
    def parse(**fields: Any) -> Any:
        if kind == "chat":
            return parse_chat({"messages": MSGS, **fields}, served_model="m", limits=LIMITS)
        return parse_completion({"prompt": "Hi", **fields}, served_model="m", limits=LIMITS)

    req = parse(detach_timeout=300, stream=True)
    assert req.detach_timeout == 300.0 and "detach_timeout" not in req.body["params"]
    assert parse().detach_timeout is None and parse(detach_timeout=None).detach_timeout is None
    for value, words in ((900, "at most 600 seconds (--max-detach-timeout)"), (0, "above 0"),
                         ("300", "must be a number")):  # fmt: skip
        with pytest.raises(ApiError) as info:
            parse(detach_timeout=value)
        err = info.value
        assert err.status == 400 and err.param == "detach_timeout" and err.code == "bad_request"
        assert words in err.message


def test_hello_tells_the_default_and_the_cap() -> None:
    hello = p.hello_frame(20.0, max_frame_bytes=1024, server="s", detach=(30.0, 600.0))
    assert hello["detach_timeout"] == 30.0 and hello["max_detach_timeout"] == 600.0
    assert "max_detach_timeout" not in p.hello_frame(20.0, max_frame_bytes=1024, server="s")


# --- the gateway's flag -----------------------------------------------------------


def gateway_settings(*argv: str) -> Settings:
    parser = argparse.ArgumentParser()
    options.add_gateway_options(parser)
    return Settings.from_args(parser.parse_args(["--redis-url", "redis://x", *argv]))


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gateway_settings().max_detach_timeout == 600.0
    assert gateway_settings("--max-detach-timeout", "900").max_detach_timeout == 900.0
    monkeypatch.setenv("TOKENRELAY_MAX_DETACH_TIMEOUT", "120")
    assert gateway_settings().max_detach_timeout == 120.0


@pytest.mark.parametrize(
    "argv",
    [
        ("--max-detach-timeout", "0"),
        ("--max-detach-timeout", "-5"),
        ("--max-detach-timeout", "inf"),
        ("--max-detach-timeout", "nan"),
        ("--max-detach-timeout", "20", "--detach-timeout", "30"),
    ],
)
def test_a_bad_cap_stops_the_gateway_at_start(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="--max-detach-timeout"):
        gateway_settings(*argv)


def test_the_cap_may_equal_the_default() -> None:
    settings = gateway_settings("--max-detach-timeout", "45", "--detach-timeout", "45")
    assert settings.max_detach_timeout == settings.detach_timeout == 45.0
