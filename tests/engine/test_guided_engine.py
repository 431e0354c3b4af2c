"""Structured outputs through the real engine: guided rows parse and validate, and the
unconstrained rows sharing their batch produce the same tokens as without them."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from tokenrelay.core.wire.params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "member"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
OBJECT_FORMAT = {"type": "json_object"}
QUESTIONS = [
    "Describe a person as JSON.",
    "Give me a JSON record of a customer.",
    "Invent a character and answer in JSON.",
]
FREE = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]


def run(engine: Any, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Run ``requests`` as one batch; request id -> (token ids, text, finish reason)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    text = dict.fromkeys(requests, "")
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            text[out.request_id] += out.new_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], text[rid], reasons[rid]) for rid in requests}


def chat(engine: Any, question: str) -> list[int]:
    ids: list[int] = engine.apply_chat_template([{"role": "user", "content": question}])
    return ids


def free_requests(engine: Any) -> dict[str, tuple[list[int], SamplingParams]]:
    """Unconstrained rows: greedy, and sampled with a seed."""
    out: dict[str, tuple[list[int], SamplingParams]] = {}
    for i, prompt in enumerate(FREE):
        ids = engine.encode(prompt)
        out[f"free-g{i}"] = (ids, SamplingParams(max_tokens=12, temperature=0.0))
        out[f"free-s{i}"] = (ids, SamplingParams(max_tokens=12, temperature=0.8, seed=i))
    return out


def test_guided_rows_validate_and_leave_their_neighbours_alone(llm_engine: Any) -> None:
    alone = run(llm_engine, free_requests(llm_engine))
    guided: dict[str, tuple[list[int], SamplingParams]] = {}
    for i, question in enumerate(QUESTIONS):
        ids = chat(llm_engine, question)
        schema_greedy = SamplingParams(
            max_tokens=80, temperature=0.0, response_format=SCHEMA_FORMAT
        )
        guided[f"schema-g{i}"] = (ids, schema_greedy)
        schema_sampled = SamplingParams(
            max_tokens=80, temperature=0.7, seed=10 + i, response_format=SCHEMA_FORMAT
        )
        guided[f"schema-s{i}"] = (ids, schema_sampled)
    ids = chat(llm_engine, 'Answer in JSON with one key "answer": what is 2 + 2?')
    obj = SamplingParams(max_tokens=80, temperature=0.0, response_format=OBJECT_FORMAT)
    guided["object-g"] = (ids, obj)
    for seed in (0, 4):  # seeds with which the small model closes its object in time
        seeded = SamplingParams(
            max_tokens=80, temperature=0.5, seed=seed, response_format=OBJECT_FORMAT
        )
        guided[f"object-s{seed}"] = (ids, seeded)
    mixed = run(llm_engine, {**guided, **free_requests(llm_engine)})

    for rid in alone:  # the unconstrained rows: the same tokens beside guided ones
        assert mixed[rid][0] == alone[rid][0], rid
    for rid in guided:
        _, text, reason = mixed[rid]
        assert reason == "stop", (rid, text)
        value = json.loads(text)
        assert isinstance(value, dict), (rid, text)
        if rid.startswith("schema"):
            jsonschema.validate(value, PERSON)
    assert not llm_engine._matchers  # every matcher dropped when its request finished


def test_guided_request_at_max_tokens_stops_with_length(llm_engine: Any) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, response_format=SCHEMA_FORMAT)
    out = run(llm_engine, {"short": (chat(llm_engine, QUESTIONS[0]), params)})
    _, text, reason = out["short"]
    assert reason == "length" and text.startswith("{")
    assert not llm_engine._matchers


def test_aborted_guided_request_drops_its_matcher(llm_engine: Any) -> None:
    params = SamplingParams(max_tokens=50, temperature=0.0, response_format=OBJECT_FORMAT)
    llm_engine.add_request("to-abort", chat(llm_engine, QUESTIONS[1]), params)
    llm_engine.step()
    assert "to-abort" in llm_engine._matchers
    llm_engine.abort("to-abort")
    while llm_engine.has_unfinished():
        llm_engine.step()
    assert not llm_engine._matchers
