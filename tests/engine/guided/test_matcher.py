"""engine/guided/matcher.py: walks through the masks only ever give JSON that parses and
validates, and EOS is allowed exactly when the document is complete.

The walks run as the engine will: a batch of sequences, one :func:`fill_bitmask` call
per step for all of them, the bitmask applied to a batch of logits by
:func:`apply_bitmask`, then one token per row (greedy or sampled) accepted by its
matcher. The logits are random, tilted towards short and closing tokens and EOS so
that walks end within the step budget; every token they pick is the real tokenizer's.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from tokenrelay.core.wire.response_format import ResponseFormat, parse_response_format
from tokenrelay.engine.guided.bitmask import allocate_bitmask, apply_bitmask
from tokenrelay.engine.guided.compiler import GrammarCompiler
from tokenrelay.engine.guided.matcher import GuidedMatcher, fill_bitmask

EOS = 2
VOCAB = 49152
ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "maxLength": 30},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["FR", "DE", "US"]},
    },
    "required": ["street", "country"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, dict[str, Any] | None] = {
    "json_object": None,
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
            "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
            "address": ADDRESS,
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "role", "scores", "address"],
        "additionalProperties": False,
    },
    "values": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "boolean"}]},
            "when": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "const": {"const": {"k": [1, "two"]}},
        },
        "required": ["ratio", "maybe", "pair", "when", "id", "const"],
    },
    "tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "top_level_array": {"type": "array", "items": {"type": "string", "maxLength": 8}},
    # complete after each digit but never stopped: EOS allowed while more could follow
    "top_level_integer": {"type": "integer", "minimum": -5000, "maximum": 99999},
}


def response_format(name: str) -> ResponseFormat:
    schema = SCHEMAS[name]
    if schema is None:
        return ResponseFormat("json_object")
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    assert fmt is not None
    return fmt


def check_document(name: str, text: str) -> None:
    """``text`` parses, and validates against the schema (a JSON object for json_object)."""
    value = json.loads(text)
    schema = SCHEMAS[name] or {"type": "object"}
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.Draft202012Validator(schema, format_checker=checker).validate(value)


@pytest.fixture(scope="module")
def tilt(tokenizer: Any) -> torch.Tensor:
    """A logit bias per token: +3 for tokens that close strings, arrays or objects,
    +1.5 for 1-2 character tokens, +4 for EOS."""
    texts = [tokenizer.decode([i]) for i in range(VOCAB)]
    bias = torch.tensor([1.5 if 0 < len(t) <= 2 else 0.0 for t in texts])
    bias += torch.tensor([3.0 if any(c in t for c in '"]}') else 0.0 for t in texts])
    bias[EOS] = 4.0
    return bias


def walk_batch(
    compiler: GrammarCompiler,
    tokenizer: Any,
    tilt: torch.Tensor,
    name: str,
    *,
    rows: int,
    seed: int,
    greedy: bool,
    steps: int = 160,
) -> int:
    """Walk ``rows`` sequences of schema ``name`` together; returns how many finished."""
    fmt = response_format(name)
    matchers = [compiler.matcher(fmt) for _ in range(rows)]
    tokens: list[list[int]] = [[] for _ in range(rows)]
    live = list(range(rows))
    bitmask = allocate_bitmask(rows, VOCAB)
    gen = torch.Generator().manual_seed(seed)
    finished = 0
    for _ in range(steps):
        if not live:
            break
        batch = [matchers[i] for i in live]
        fill_bitmask(batch, bitmask)
        logits = torch.randn(len(live), VOCAB, generator=gen) * 2 + tilt
        apply_bitmask(logits, bitmask[: len(live)])
        for row, i in enumerate(live):  # EOS allowed exactly when the text is complete
            eos_ok = bool(torch.isfinite(logits[row, EOS]))
            assert eos_ok == matchers[i].accepting, (name, tokenizer.decode(tokens[i]))
            if eos_ok:
                check_document(name, tokenizer.decode(tokens[i]))
        if greedy:
            picked = logits.argmax(dim=-1)
        else:
            picked = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).view(-1)
        still = []
        for row, i in enumerate(live):
            token = int(picked[row])
            assert torch.isfinite(logits[row, token])
            assert matchers[i].accept(token), (name, tokenizer.decode([*tokens[i], token]))
            if token == EOS or matchers[i].stopped:
                finished += 1
                text = tokens[i] if token == EOS else [*tokens[i], token]
                check_document(name, tokenizer.decode(text))
            else:
                tokens[i].append(token)
                still.append(i)
        live = still
    return finished


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_walks_parse_and_validate(
    compiler: GrammarCompiler, tokenizer: Any, tilt: torch.Tensor, name: str
) -> None:
    finished = walk_batch(compiler, tokenizer, tilt, name, rows=8, seed=11, greedy=False)
    assert finished >= 4, f"only {finished} of 8 walks of {name} ended"


@pytest.mark.parametrize("name", ["person", "json_object"])
def test_greedy_walks_parse_and_validate(
    compiler: GrammarCompiler, tokenizer: Any, tilt: torch.Tensor, name: str
) -> None:
    finished = walk_batch(compiler, tokenizer, tilt, name, rows=4, seed=5, greedy=True)
    assert finished >= 2


def test_a_complete_document_allows_eos_only(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = compiler.matcher(response_format("person"))
    doc = {
        "name": "Ann",
        "age": 30,
        "role": "admin",
        "scores": [1, 2],
        "address": {"street": "Main St", "country": "FR"},
    }
    ids = tokenizer(json.dumps(doc), add_special_tokens=False)["input_ids"]
    assert EOS not in m.allowed().tolist()
    for token in ids[:-1]:
        assert m.accept(token)
        assert not m.stopped
    assert m.accept(ids[-1]) and m.stopped and m.accepting
    assert m.allowed().tolist() == [EOS]
    assert m.accept(EOS) and m.error is None


def test_a_forbidden_token_fails_the_matcher_to_eos(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    m = compiler.matcher(response_format("person"))
    bad = tokenizer("hello", add_special_tokens=False)["input_ids"][0]
    assert bad not in m.allowed().tolist()
    assert not m.accept(bad)
    assert m.error and m.stopped
    assert m.allowed().tolist() == [EOS]


def test_fork_is_independent(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = compiler.matcher(ResponseFormat("json_object"))
    for token in tokenizer('{"a": ', add_special_tokens=False)["input_ids"]:
        assert m.accept(token)
    twin = m.fork()
    one = tokenizer("1}", add_special_tokens=False)["input_ids"]
    for token in one:
        assert twin.accept(token)
    assert twin.stopped and not m.stopped
    assert torch.equal(m.fork().allowed(), m.allowed())
    m.rollback(0)


def test_fill_bitmask_rows_and_checks(compiler: GrammarCompiler) -> None:
    a = compiler.matcher(response_format("person"))
    b = compiler.matcher(response_format("top_level_array"))
    bitmask = allocate_bitmask(3, VOCAB)
    fill_bitmask([a, b], bitmask)
    assert not torch.equal(bitmask[0], bitmask[1])
    assert bool((bitmask[2] == -1).all())  # rows past the matchers untouched
    fill_bitmask([], bitmask)
    with pytest.raises(ValueError, match="rows"):
        fill_bitmask([a, b], allocate_bitmask(1, VOCAB))
    with pytest.raises(ValueError, match="words"):
        fill_bitmask([a], allocate_bitmask(1, VOCAB + 64))
    with pytest.raises(ValueError, match="int32"):
        fill_bitmask([a], torch.zeros((1, 1536), dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        fill_bitmask([a], allocate_bitmask(2, 2 * VOCAB)[:, ::2])


def test_guided_matcher_type(compiler: GrammarCompiler) -> None:
    assert isinstance(compiler.matcher(ResponseFormat("json_object")), GuidedMatcher)
