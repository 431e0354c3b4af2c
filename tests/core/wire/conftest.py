"""Fixtures of the wire tests."""

from __future__ import annotations

import pytest

from tokenrelay.core.wire import schema_verdicts


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The schemas llguidance is asked about from now on."""
    seen: list[str] = []
    real = schema_verdicts.llguidance_verdict

    def counted(text: str) -> str:
        seen.append(text)
        return real(text)

    monkeypatch.setattr(schema_verdicts, "llguidance_verdict", counted)
    return seen
