"""--upstream and its companions, checked before anything starts."""

from __future__ import annotations

import pytest

from tokenrelay.core.cli import build_parser
from tokenrelay.worker.upstream.config import UpstreamConfig, base_url, redact


def test_the_base_url_is_normalised_and_gets_v1_when_it_has_no_path() -> None:
    assert base_url("http://127.0.0.1:11434") == "http://127.0.0.1:11434/v1"
    assert base_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert base_url("https://api.example.com/openai/v1") == "https://api.example.com/openai/v1"
    for bad in ("ftp://h/v1", "h:8000", "http:///v1", "http://h/v1?x=1", "http://h:99999/v1"):
        with pytest.raises(ValueError, match="--upstream"):
            base_url(bad)


def test_a_password_in_the_url_is_never_logged() -> None:
    assert redact("http://u:secret@h:1/v1") == "http://u:***@h:1/v1"
    assert redact("http://h/v1") == "http://h/v1"


def test_the_worker_flags_and_their_environment_make_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENRELAY_UPSTREAM_API_KEY", "sk-test")
    args = build_parser().parse_args(["worker", "--upstream", "http://h:8000/v1",
                                      "--upstream-model", "m", "--max-inflight", "8",
                                      "--upstream-timeout", "5"])  # fmt: skip
    cfg = UpstreamConfig.from_args(args)
    assert (cfg.url, cfg.model, cfg.api_key, cfg.max_inflight) == ("http://h:8000/v1", "m",
                                                                   "sk-test", 8)  # fmt: skip
    assert cfg.timeout == 5.0 and cfg.connect_timeout == 5.0
    assert cfg.auth_headers() == {"Authorization": "Bearer sk-test"}
    with pytest.raises(ValueError, match="--max-inflight"):
        UpstreamConfig("http://h/v1", max_inflight=0)


def test_the_api_key_never_shows_in_a_repr() -> None:
    cfg = UpstreamConfig("http://up:8000/v1", api_key="sk-very-secret")
    assert "sk-very-secret" not in repr(cfg) and cfg.api_key == "sk-very-secret"


def test_the_deadlines_and_caps_have_defaults_and_are_checked() -> None:
    cfg = UpstreamConfig("http://h/v1")
    assert cfg.head_timeout <= cfg.first_token_timeout <= cfg.total_timeout
    assert cfg.max_line_bytes >= 1024 and cfg.max_event_bytes >= 1024
    assert cfg.max_idle_run >= 1 and cfg.max_idle_lines >= cfg.max_idle_run
    for bad in ({"head_timeout": 0}, {"total_timeout": float("inf")},
                {"first_token_timeout": -1.0}, {"head_timeout": True}):  # fmt: skip
        with pytest.raises(ValueError, match="must be"):
            UpstreamConfig("http://h/v1", **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="head_timeout <= first_token_timeout <= total_timeout"):
        UpstreamConfig("http://h/v1", head_timeout=10, first_token_timeout=5)
    for bad in ({"max_line_bytes": 100}, {"max_event_bytes": 2.5e6}, {"max_idle_run": 0},
                {"max_idle_lines": 0}):  # fmt: skip
        with pytest.raises(ValueError, match="must be an integer >="):
            UpstreamConfig("http://h/v1", **bad)  # type: ignore[arg-type]
