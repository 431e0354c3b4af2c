"""Browser pages: the chat UI at ``/``, the widget demo at ``/embed-demo``, and ``/static``.

Templates come from ``web/templates`` and assets from ``static/`` (found by
:func:`core.runtime.asset_dir`), so the pages work from a source checkout and from a wheel.
``/`` takes URL parameters that preset the generation settings for reproducible runs
(``/?temperature=0&max_tokens=64&seed=1&system=...``) and ``?debug=1`` for the QA panel;
docs/client.md describes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenrelay.core.runtime import asset_dir, version
from tokenrelay.core.wire.requests import DEFAULT_MAX_TOKENS_LIMIT, MAX_SEED, MAX_TEMPERATURE

TEMPLATES_DIR = asset_dir("web") / "templates"
STATIC_DIR = asset_dir("static")

MAX_SYSTEM_CHARS = 8000

templates = Jinja2Templates(directory=str(TEMPLATES_DIR))


def _assetversion() -> str:
    """Cache-busting token for asset URLs: the package version plus the newest asset mtime
    (the modules in static/'s subfolders included; the pinned vendor files never change)."""
    try:
        newest = max(
            int(p.stat().st_mtime)
            for p in STATIC_DIR.rglob("*.js")
            if "vendor" not in p.relative_to(STATIC_DIR).parts
        )
    except ValueError:
        newest = 0
    return f"{version()}-{newest:x}"


# --- URL presets ----------------------------------------------------------------------------


def _float_in(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw)
        if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
            raise ValueError(raw)
        return value

    return parse


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw.strip(), 10)
        if not lo <= value < hi:
            raise ValueError(raw)
        return value

    return parse


def _text(raw: str) -> str:
    if len(raw) > MAX_SYSTEM_CHARS:
        raise ValueError("too long")
    return raw


PRESET_PARSERS: dict[str, Callable[[str], Any]] = {
    "temperature": _float_in(0.0, MAX_TEMPERATURE),
    "max_tokens": _int_in(1, DEFAULT_MAX_TOKENS_LIMIT + 1),
    "top_p": _float_in(0.0, 1.0, lo_open=True),
    "top_k": _int_in(0, 1_000_001),
    "seed": _int_in(0, MAX_SEED),
    "system": _text,
}


@dataclass
class Presets:
    """Generation settings preset from the URL; ``ignored`` names the values refused."""

    values: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def presets_from_query(query: Mapping[str, str]) -> Presets:
    """Validate the preset parameters of a query string (unknown names are left alone)."""
    out = Presets()
    for name, parse in PRESET_PARSERS.items():
        raw = query.get(name)
        if raw is None or (raw == "" and name != "system"):
            continue
        try:
            out.values[name] = parse(raw)
        except ValueError:
            out.ignored.append(name)
    return out


def _flag(query: Mapping[str, str], name: str) -> bool:
    return query.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# --- security headers -----------------------------------------------------------------------


def _csp(request: Request) -> str:
    host = request.headers.get("host", "")
    ws = ("wss://" if request.url.scheme == "https" else "ws://") + host if host else ""
    return "; ".join(
        [
            "default-src 'self'",
            "script-src 'self'",
            "style-src 'self'",
            "img-src 'self' data:",
            f"connect-src 'self' {ws}".strip(),
            "object-src 'none'",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'self'",
        ]
    )


def _page_headers(request: Request) -> dict[str, str]:
    return {
        "Content-Security-Policy": _csp(request),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",
        "Cache-Control": "no-store",
    }


class _StaticHeaders:
    """Wrap StaticFiles: CORS so ``widget.js`` can import its modules from any site, and
    ``no-cache`` (ETag revalidation) so upgrades are picked up at once."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if path.endswith((".py", ".pyc")) or "__pycache__" in path:
            await Response("Not Found", status_code=404)(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"access-control-allow-origin", b"*"),
                    (b"cross-origin-resource-policy", b"cross-origin"),
                    (b"x-content-type-options", b"nosniff"),
                    (b"cache-control", b"no-cache"),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


# --- pages ----------------------------------------------------------------------------------


def _static_base(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/") + "/static"


async def index(request: Request) -> Response:
    """The chat page; URL parameters preset the generation settings."""
    presets = presets_from_query(request.query_params)
    context = {
        "static_base": _static_base(request),
        "presets": presets.values,
        "ignored": presets.ignored,
        "debug": _flag(request.query_params, "debug"),
        "asset_version": _assetversion(),
        "version": version(),
    }
    return templates.TemplateResponse(
        request, "index.html", context, headers=_page_headers(request)
    )


async def embed_demo(request: Request) -> Response:
    """A plain third-party-looking page with the widget embedded by one script tag."""
    endpoint = str(request.base_url).rstrip("/")
    context = {
        "static_base": _static_base(request),
        "endpoint": endpoint,
        "asset_version": _assetversion(),
    }
    return templates.TemplateResponse(
        request, "embed_demo.html", context, headers=_page_headers(request)
    )


def page_routes() -> list[BaseRoute]:
    """Routes for the gateway app: ``/``, ``/embed-demo`` and the ``/static`` mount."""
    static_app = _StaticHeaders(StaticFiles(directory=str(STATIC_DIR)))
    return [
        Route("/", index, methods=["GET", "HEAD"], name="index"),
        Route("/embed-demo", embed_demo, methods=["GET", "HEAD"], name="embed_demo"),
        Mount("/static", app=static_app, name="static"),
    ]
