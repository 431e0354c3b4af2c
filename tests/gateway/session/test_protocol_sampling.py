"""The ``generate`` frame's penalty, logit bias, stop token and logprobs params (sans I/O):
the validator the OpenAI API shares, with the WebSocket's own names."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from tokenrelay.gateway.session import protocol as p


def generate(params: dict[str, Any], limits: p.Limits | None = None) -> p.ClientFrame:
    frame = {"type": "generate", "prompt": "x", "params": params}
    return p.parse_frame(json.dumps(frame), limits)


def test_sampling_params_travel_to_the_worker() -> None:
    frame = generate(
        {
            "presence_penalty": -1.5,
            "frequency_penalty": 2,
            "repetition_penalty": 1.3,
            "min_p": 0.1,
            "logit_bias": {"7": -100, "8": 0.5},
            "stop_token_ids": [2, 3],
            "logprobs": 20,
        }
    )
    assert isinstance(frame, p.Generate)
    params = frame.body()["params"]
    assert params["logit_bias"] == {7: -100.0, 8: 0.5}
    assert params["stop_token_ids"] == [2, 3] and params["logprobs"] == 20
    assert params["presence_penalty"] == -1.5 and params["frequency_penalty"] == 2.0
    # the worker rebuilds them from JSON (object keys are strings there)
    again = json.loads(json.dumps(params))
    assert p.SamplingParams(**again) == frame.params


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {"1": -101}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": True}}, "logit_bias"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # OpenAI's name: not a WebSocket param
    ],
)
def test_bad_values_are_bad_requests(params: dict[str, Any], needle: str) -> None:
    with pytest.raises(p.ProtocolError) as info:
        generate(params)
    assert info.value.code == "bad_request" and needle in info.value.message


def test_stop_token_ids_and_logit_bias_are_bounded() -> None:
    with pytest.raises(p.ProtocolError) as info:
        generate({"stop_token_ids": list(range(65))})
    assert info.value.code == "too_large"
    limits = dataclasses.replace(p.Limits(), vocab_size=10)
    generate({"logit_bias": {"9": 1}}, limits)
    with pytest.raises(p.ProtocolError, match="vocabulary"):
        generate({"logit_bias": {"10": 1}}, limits)
