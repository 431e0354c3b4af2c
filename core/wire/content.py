"""A chat message's content: a string, or a list of text and image parts, sans I/O.

OpenAI's parts are ``{"type": "text", "text": ...}`` and ``{"type": "image_url",
"image_url": {"url": ..., "detail": ...}}``. Text parts alone are joined into one string
(what every engine takes). A list with an image part is kept as parts, each with only the
fields above, for a relay worker to pass to an upstream that takes images; our engine
takes text only and refuses such a request (:data:`TEXT_ONLY`).

An image's ``url`` is either a ``data:`` URL (``data:image/<png|jpeg|gif|webp>;base64,``
and at most :data:`MAX_IMAGE_BYTES` decoded bytes), or an ``https:`` URL of at most
:data:`MAX_IMAGE_URL` characters, passed on as it is: the gateway never fetches it (the
upstream does, if it takes it). Any other scheme is refused. A request carries at most
:data:`MAX_IMAGES` images, in ``user`` messages only. Every refusal is ``bad_request``
naming the part (``messages[i].content[j]``) and, for a limit, the limit.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from tokenrelay.core.wire.errors import RequestError
from tokenrelay.core.wire.vocabulary import ErrorCode

__all__ = [
    "IMAGE_DETAILS",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_URL",
    "TEXT_ONLY",
    "Parts",
    "has_images",
    "parse_content",
    "text_of",
]

MAX_IMAGE_BYTES = 4 * 1024 * 1024  # decoded bytes of one data: URL image
MAX_IMAGES = 8  # image parts in one request
MAX_IMAGE_URL = 8192  # characters of one https: image URL
IMAGE_DETAILS = ("auto", "low", "high")
TEXT_ONLY = (
    "this model takes text only: image content parts need a relay worker (--upstream) "
    "whose upstream server takes images"
)
_DATA_URL = re.compile(r"data:image/(png|jpeg|gif|webp);base64,")

Parts = tuple[dict[str, Any], ...]  # a content's parts, when an image is among them


class _Refusal:
    """The ``bad_request`` s of one message's content (their field: ``messages[i].content``)."""

    def __init__(self, index: int) -> None:
        self.field = f"messages[{index}].content"

    def __call__(self, where: str, message: str) -> RequestError:
        return RequestError(ErrorCode.BAD_REQUEST, f"{self.field}{where} {message}", self.field)

    def only(self, part: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
        extra = sorted(set(part) - set(keys))
        if extra:
            raise self(f"{where}.{extra[0]}", "is not a field of a content part")


def _image(raw: Any, where: str, bad: _Refusal) -> dict[str, Any]:
    """An ``image_url`` object, checked (see the module doc)."""
    if not isinstance(raw, dict):
        raise bad(where, "must be an object with a 'url'")
    bad.only(raw, ("url", "detail"), where)
    url, detail = raw.get("url"), raw.get("detail")
    if not isinstance(url, str):
        raise bad(f"{where}.url", "must be a string")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise bad(f"{where}.detail", f"must be one of {', '.join(IMAGE_DETAILS)}")
    too_big = f"is over the limit of {MAX_IMAGE_BYTES} bytes ({MAX_IMAGE_BYTES >> 20} MiB) an image"
    if url[:6].lower() == "https:":
        if len(url) > MAX_IMAGE_URL:
            raise bad(f"{where}.url", f"is over the limit of {MAX_IMAGE_URL} characters")
    elif url[:5].lower() == "data:":
        head = _DATA_URL.match(url)
        if head is None:
            raise bad(f"{where}.url", "must start data:image/<png|jpeg|gif|webp>;base64,")
        payload = url[head.end() :]
        if len(payload) // 4 * 3 > MAX_IMAGE_BYTES + 2:  # too long to hold less: not decoded
            raise bad(f"{where}.url", too_big)
        try:
            size = len(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            raise bad(f"{where}.url", "must hold base64 after its comma") from None
        if size > MAX_IMAGE_BYTES:
            raise bad(f"{where}.url", too_big)
    else:
        raise bad(f"{where}.url", "must be an https: or a data: URL (this server never "
                  "fetches an image)")  # fmt: skip
    return {"url": url} if detail is None else {"url": url, "detail": detail}


def parse_content(value: Any, index: int, role: str) -> str | Parts:
    """Message ``index``'s content: its text (a string, text parts joined, ``""`` for an
    assistant's ``null``), or its checked parts when an image is among them.
    :class:`RequestError` (``bad_request``, field ``messages[i].content``) otherwise."""
    bad = _Refusal(index)
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":  # only tool calls
        return ""
    if not isinstance(value, list):
        raise bad("", "must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    images = 0
    for j, part in enumerate(value):
        where = f"[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            bad.only(part, ("type", "text"), where)
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}.text", "must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if role != "user":
                raise bad(where, "is an image: images are taken in user messages only")
            bad.only(part, ("type", "image_url"), where)
            image = _image(part.get("image_url"), f"{where}.image_url", bad)
            parts.append({"type": "image_url", "image_url": image})
            images += 1
        else:
            raise bad(where, "must be an object with type 'text' or 'image_url'")
    if not images:
        return "".join(p["text"] for p in parts)
    return tuple(parts)


def has_images(content: Any) -> bool:
    """Whether a message's content (as a request body carries it) holds an image part."""
    return isinstance(content, list | tuple) and any(
        isinstance(p, dict) and p.get("type") == "image_url" for p in content
    )


def text_of(parts: Parts) -> str:
    """The text of a content's parts, joined (what counts towards the input's size)."""
    return "".join(p["text"] for p in parts if p.get("type") == "text")
