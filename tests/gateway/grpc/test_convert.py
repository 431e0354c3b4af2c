"""gRPC messages <-> protocol v1 frames: the WebSocket's parser and frame builders decide."""

from __future__ import annotations

import json

import pytest

from tests.gateway.grpc.client import frame_dict, pb2
from tokenrelay.core.wire.tools import call_id
from tokenrelay.gateway.grpc.convert import client_frame_json, parse_client_frame, server_frame
from tokenrelay.gateway.session import protocol as p

LIMITS = p.Limits()


def test_a_generate_parses_as_its_websocket_frame_would() -> None:
    params = pb2.SamplingParams(
        temperature=0.0, top_p=0.9, top_k=5, max_tokens=7, seed=3, stop=["\n"], ignore_eos=False,
        min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        logit_bias={42: -3.0}, stop_token_ids=[2], logprobs=2, n=2,
        response_format_json='{"type": "json_object"}',
    )  # fmt: skip
    messages = [pb2.Message(role="system", content="Be brief."),
                pb2.Message(role="user", content="Hi")]  # fmt: skip
    frame = pb2.ClientFrame(generate=pb2.Generate(request_id="r1", messages=messages,
                                                  params=params, model="m"))  # fmt: skip
    ws = {
        "type": "generate", "request_id": "r1", "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "params": {"temperature": 0, "top_p": 0.9, "top_k": 5, "max_tokens": 7, "seed": 3,
                   "stop": ["\n"], "ignore_eos": False, "min_p": 0.1, "presence_penalty": 0.5,
                   "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                   "logit_bias": {"42": -3}, "stop_token_ids": [2], "logprobs": 2, "n": 2,
                   "response_format": {"type": "json_object"}},
    }  # fmt: skip
    assert parse_client_frame(frame, LIMITS) == p.parse_frame(json.dumps(ws), LIMITS)


def test_unset_fields_take_protocol_v1_defaults() -> None:
    frame = pb2.ClientFrame(generate=pb2.Generate(prompt="Once"))
    assert client_frame_json(frame) == {"type": "generate", "prompt": "Once"}
    g = parse_client_frame(frame, LIMITS)
    assert g == p.parse_frame('{"type":"generate","prompt":"Once"}', LIMITS)
    resume = pb2.ClientFrame(resume=pb2.Resume(stream_id="s", resume_token="t"))
    assert client_frame_json(resume) == {"type": "resume", "stream_id": "s",
                                         "resume_token": "t", "after": 0}  # fmt: skip
    cancel = pb2.ClientFrame(cancel=pb2.Cancel(stream_id="s"))
    assert client_frame_json(cancel) == {"type": "cancel", "stream_id": "s"}


@pytest.mark.parametrize(
    ("frame", "code", "words"),
    [
        (pb2.ClientFrame(), "bad_request", "empty ClientFrame"),
        (pb2.ClientFrame(generate=pb2.Generate(prompt="x", params=pb2.SamplingParams(
            temperature=float("nan")))), "bad_request", "finite"),
        (pb2.ClientFrame(generate=pb2.Generate(request_id="r", messages=[pb2.Message(
            role="assistant", tool_calls_json="[")])), "bad_request", "tool_calls_json"),
        (pb2.ClientFrame(generate=pb2.Generate(prompt="x", messages=[pb2.Message(
            role="user", content="y")])), "bad_request", "not both"),
        (pb2.ClientFrame(resume=pb2.Resume(stream_id="A" * 22, resume_token="t", after=-1)),
         "bad_request", "after"),
    ],
)  # fmt: skip
def test_bad_frames_are_protocol_errors(frame: object, code: str, words: str) -> None:
    with pytest.raises(p.ProtocolError) as err:
        parse_client_frame(frame, LIMITS)
    assert err.value.code == code and words in err.value.message


def test_server_frames_carry_the_websocket_frames_fields() -> None:
    frames = [
        p.hello_frame(20.0, max_frame_bytes=1024, server="tokenrelay/x", detach=(30.0, 600.0)),
        p.started_frame("r1", "S", "T", 42, 1),
        p.token_frame("S", 1, "Hel"),
        p.done_frame("S", 9, "length", 42, 8, "why"),
        p.token_frame("S", 2, "", calls='[[0, "get_time", "{\\"zone\\""]]'),
        p.resumed_frame("S", 17),
        p.cancelled_frame("S", "finished", "stop"),
        p.error_frame("rate_limited", "slow", request_id="r1", retry_after=1.5),
        p.pong_frame(),
        {"type": "notice", "code": "shutting_down", "message": "bye", "drain_s": 30},
    ]
    got = [frame_dict(server_frame(pb2, f)) for f in frames]
    hello = {"type": "hello", "protocol": 1, "heartbeat_s": 20.0, "max_frame_bytes": 1024,
             "server": "tokenrelay/x", "worker_ready": True, "detach_timeout": 30.0,
             "max_detach_timeout": 600.0}  # fmt: skip
    assert got[0] == hello
    assert got[1]["index"] == 1 and got[1]["prompt_tokens"] == 42
    assert got[2] == {"type": "token", "stream_id": "S", "seq": 1, "text": "Hel",
                      "logprobs_json": "", "tool_calls_json": ""}  # fmt: skip
    deltas = json.loads(got.pop(4)["tool_calls_json"])
    assert deltas == [{"index": 0, "id": call_id("S", 0), "type": "function",
                       "function": {"name": "get_time", "arguments": '{"zone"'}}]  # fmt: skip
    assert got[3]["usage"] == {"prompt_tokens": 42, "completion_tokens": 8}
    assert got[3]["message"] == "why" and got[3]["finish_reason"] == "length"
    assert got[4] == {"type": "resumed", "stream_id": "S", "after": 17}
    assert got[5]["finish_reason"] == "stop"
    assert got[6]["retry_after"] == 2 and got[6]["request_id"] == "r1"
    assert got[7] == {"type": "pong"}
    assert got[8]["drain_s"] == 30
    with pytest.raises(ValueError):
        server_frame(pb2, {"type": "nope"})


def test_detach_timeout_travels_in_the_params_as_on_the_websocket() -> None:
    params = pb2.SamplingParams(max_tokens=8, detach_timeout=300.0)
    frame = pb2.ClientFrame(generate=pb2.Generate(request_id="r1", prompt="Hi", params=params))
    assert client_frame_json(frame)["params"] == {"max_tokens": 8, "detach_timeout": 300.0}
    g = parse_client_frame(frame, LIMITS)
    assert isinstance(g, p.Generate) and g.detach_timeout == 300.0
    assert "detach_timeout" not in g.body()["params"]
    unset = parse_client_frame(pb2.ClientFrame(generate=pb2.Generate(prompt="Hi")), LIMITS)
    assert isinstance(unset, p.Generate) and unset.detach_timeout is None
    for value, words in ((601.0, "at most 600 seconds"), (0.0, "above 0"),
                         (float("inf"), "finite")):  # fmt: skip
        params = pb2.SamplingParams(detach_timeout=value)
        bad = pb2.ClientFrame(generate=pb2.Generate(request_id="r1", prompt="Hi", params=params))
        with pytest.raises(p.ProtocolError) as err:
            parse_client_frame(bad, LIMITS)
        assert err.value.code == "bad_request" and words in err.value.message


def _gen(**fields: object) -> object:
    return pb2.ClientFrame(generate=pb2.Generate(request_id="r1", **fields))


def _params(**fields: object) -> object:
    return _gen(prompt="Hi", params=pb2.SamplingParams(**fields))


@pytest.mark.parametrize(
    ("frame", "code", "words", "ws"),
    [
        (_gen(messages=[pb2.Message(role="user", content="x")] * 257), "too_large",
         "messages may hold at most 256", {"messages": [{"role": "user", "content": "x"}] * 257}),
        (_gen(prompt="x" * 200_001), "too_large", "the limit is 200000", {"prompt": "x" * 200_001}),
        (_params(stop=["a"] * 100_000), "too_large", "params.stop may hold at most 16 strings",
         {"prompt": "Hi", "params": {"stop": ["a"] * 100_000}}),
        (_params(stop=["a" * 201]), "too_large", "params.stop strings are limited to 200",
         {"prompt": "Hi", "params": {"stop": ["a" * 201]}}),
        (_params(stop_token_ids=range(65)), "too_large",
         "params.stop_token_ids may hold at most 64",
         {"prompt": "Hi", "params": {"stop_token_ids": list(range(65))}}),
        (_params(logit_bias={i: 1.0 for i in range(301)}), "bad_request",
         "params.logit_bias may hold at most 300",
         {"prompt": "Hi", "params": {"logit_bias": {str(i): 1 for i in range(301)}}}),
    ],
)  # fmt: skip
def test_repeated_fields_are_counted_before_any_conversion(
    frame: object, code: str, words: str, ws: dict[str, object]
) -> None:
    """Over a limit, the message itself is refused: no dict or list of its items is built
    (client_frame_json raises), with the code the WebSocket gives the same frame."""
    with pytest.raises(p.ProtocolError) as err:
        client_frame_json(frame, LIMITS)
    assert (err.value.code, err.value.request_id) == (code, "r1")
    assert words in err.value.message, err.value.message
    with pytest.raises(p.ProtocolError) as ws_err:
        p.parse_frame(json.dumps({"type": "generate", **ws}), LIMITS)
    assert ws_err.value.code == code


def test_the_counts_follow_the_gateways_limits() -> None:
    frame = _params(stop=["a", "b", "c"])
    assert client_frame_json(frame, LIMITS)["params"]["stop"] == ["a", "b", "c"]
    with pytest.raises(p.ProtocolError, match="at most 2 strings"):
        parse_client_frame(frame, p.Limits(max_stop=2))
    at_limit = _gen(messages=[pb2.Message(role="user", content="x")] * 256)
    assert isinstance(parse_client_frame(at_limit, LIMITS), p.Generate)
