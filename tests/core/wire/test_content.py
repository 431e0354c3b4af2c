"""Content parts: text joined, images kept for a relay and checked, the engine refusing them."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tokenrelay.core.wire.content import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_URL,
    MAX_IMAGES,
    TEXT_ONLY,
    parse_content,
)
from tokenrelay.core.wire.errors import RequestError
from tokenrelay.core.wire.requests import Limits, validate_messages
from tokenrelay.core.wire.stats import WorkerStats
from tokenrelay.engine.text.chat import check_messages
from tokenrelay.gateway.http.openai_request import ApiError, parse_chat
from tokenrelay.gateway.observe.readiness import text_only
from tokenrelay.gateway.session import protocol as p

PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
HTTPS = "https://example.com/cat.png?size=large"


def image(url: str, **more: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def user(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def test_text_parts_are_joined_and_images_are_kept_as_given() -> None:
    assert parse_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], 0,
                         "user") == "ab"  # fmt: skip
    parts = [{"type": "text", "text": "What is it?"}, image(PNG, detail="low"), image(HTTPS)]
    assert parse_content(parts, 0, "user") == tuple(parts)
    (msg,) = validate_messages(user(*parts), Limits())
    assert msg.content == "What is it?" and msg.body() == {"role": "user", "content": parts}


@pytest.mark.parametrize(
    ("parts", "said"),
    [
        ([image("http://example.com/cat.png")], "must be an https: or a data: URL"),
        ([image("file:///etc/passwd")], "must be an https: or a data: URL"),
        ([image("data:text/plain;base64,aGk=")], "must start data:image/"),
        ([image("data:image/png;base64,not base64!")], "must hold base64"),
        ([image(HTTPS, detail="huge")], "detail must be one of auto, low, high"),
        ([image("https://x/" + "a" * MAX_IMAGE_URL)], f"limit of {MAX_IMAGE_URL} characters"),
        ([{"type": "image_url", "image_url": HTTPS}], "must be an object with a 'url'"),
        ([{"type": "input_audio", "input_audio": {}}], "type 'text' or 'image_url'"),
        ([{"type": "text", "text": "x", "cache_control": {}}], "cache_control is not a field"),
    ],
)
def test_a_bad_part_is_a_bad_request_naming_it(parts: list[Any], said: str) -> None:
    with pytest.raises(RequestError) as info:
        validate_messages(user(*parts), Limits())
    assert info.value.code == "bad_request" and info.value.field == "messages[0].content"
    assert said in info.value.message and info.value.message.startswith("messages[0].content[0]")


def test_an_image_over_the_size_limit_and_too_many_images_are_refused_naming_the_limit() -> None:
    big = "data:image/png;base64," + base64.b64encode(b"\0" * (MAX_IMAGE_BYTES + 1)).decode()
    at = "data:image/png;base64," + base64.b64encode(b"\0" * MAX_IMAGE_BYTES).decode()
    validate_messages(user(image(at)), Limits())
    with pytest.raises(RequestError) as info:
        validate_messages(user(image(big)), Limits())
    assert info.value.code == "bad_request" and str(MAX_IMAGE_BYTES) in info.value.message
    validate_messages(user(*[image(HTTPS)] * MAX_IMAGES), Limits())
    with pytest.raises(RequestError) as info:
        validate_messages(user(*[image(HTTPS)] * (MAX_IMAGES + 1)), Limits())
    assert info.value.code == "bad_request" and f"limit is {MAX_IMAGES}" in info.value.message
    assistant = [{"role": "assistant", "content": [image(HTTPS)]}]
    with pytest.raises(RequestError, match="user messages only"):
        validate_messages(assistant, Limits())


def test_only_text_counts_towards_the_input_size() -> None:
    small = Limits(max_input_chars=20)
    validate_messages(user({"type": "text", "text": "hi"}, image(PNG)), small)  # PNG > 20
    with pytest.raises(RequestError, match="input is 21 characters"):
        validate_messages(user({"type": "text", "text": "x" * 21}, image(PNG)), small)


def test_every_transport_carries_image_parts_to_the_worker_unchanged() -> None:
    parts = [{"type": "text", "text": "Describe"}, image(HTTPS, detail="high")]
    frame = p.parse_frame(json.dumps({"type": "generate", "messages": user(*parts)}), Limits())
    assert isinstance(frame, p.Generate) and frame.body()["messages"][0]["content"] == parts
    req = parse_chat({"messages": user(*parts)}, served_model="m", limits=Limits())
    assert req.body["messages"][0]["content"] == parts
    with pytest.raises(ApiError) as api:
        parse_chat({"messages": user(image("ftp://x/y.png"))}, served_model="m", limits=Limits())
    assert api.value.status == 400 and api.value.param == "messages[0].content"


def test_our_engine_refuses_images_as_a_bad_request_saying_it_takes_text() -> None:
    with pytest.raises(ValueError, match="takes text only") as info:
        check_messages(user({"type": "text", "text": "What is it?"}, image(PNG)))
    assert TEXT_ONLY in str(info.value)


def test_a_gateway_whose_workers_all_run_our_engine_refuses_images_itself() -> None:
    engines = [WorkerStats(worker_id="a"), WorkerStats(worker_id="b")]
    assert text_only(engines) is True and text_only([]) is None
    assert text_only([*engines, WorkerStats(worker_id="r", backend="upstream")]) is False
    limits = Limits(text_only=True)
    messages = [{"role": "user", "content": "Hi"}, *user({"type": "text", "text": "x"},
                                                        image(PNG))]  # fmt: skip
    with pytest.raises(RequestError) as info:
        validate_messages(messages, limits)
    assert info.value.code == "bad_request" and info.value.field == "messages[1].content"
    assert TEXT_ONLY in info.value.message
    with pytest.raises(ApiError) as api:
        parse_chat({"messages": messages}, served_model="m", limits=limits)
    assert api.value.status == 400 and TEXT_ONLY in api.value.message
    validate_messages([{"role": "user", "content": "Hi"}], limits)  # text is fine
