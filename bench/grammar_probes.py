"""Do an engine's outputs parse and validate? Random walks over probe schemas.

For each probe schema (:data:`PROBES`: the keywords a JSON schema of a tool or an
extraction task uses) the engine compiles it (or refuses it: counted as ``refused``,
which is fine: a refused schema becomes a clear 400, never a wrong answer), then
``walks`` random token walks follow its mask: at each step a token drawn among the
allowed ones, biased towards short and closing tokens so that walks end, EOS taken
with probability 0.7 once allowed. Every finished walk is decoded and must parse
(``json.loads``) and validate (``jsonschema``, Draft 2020-12, with its format
checker); a walk that fails either is ``invalid``. Walks are seeded: every engine
meets the same draws.
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch

from bench.grammar_engines import EOS

PROBES: list[tuple[str, dict[str, Any]]] = [
    ("string maxLength 40", {"type": "string", "maxLength": 40}),
    ("string minLength 3, maxLength 8", {"type": "string", "minLength": 3, "maxLength": 8}),
    ("string pattern", {"type": "string", "pattern": "^[a-z]{2}[0-9]+$"}),
    ("integer range", {"type": "integer", "minimum": 5, "maximum": 2000}),
    ("number exclusive range", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    ("number multipleOf 0.5", {"type": "number", "multipleOf": 0.5}),
    ("array minItems, maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 3}),
    ("array uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("anyOf integer | null", {"anyOf": [{"type": "integer"}, {"type": "null"}]}),
    ("oneOf overlapping", {"oneOf": [{"type": "integer"}, {"type": "number"}]}),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}),
    ("enum, mixed", {"enum": ["x", 1, None, True]}),
    ("format date", {"type": "string", "format": "date"}),
    ("format ipv4", {"type": "string", "format": "ipv4"}),
    ("format email", {"type": "string", "format": "email"}),
    (
        "recursive $ref",
        {
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
    ),
]


def wrap(schema: dict[str, Any]) -> dict[str, Any]:
    """The probe as the one required property of an object (what a response holds);
    its ``$defs`` move to the root, where its ``$ref`` pointers look."""
    inner = {k: v for k, v in schema.items() if k != "$defs"}
    outer: dict[str, Any] = {
        "type": "object",
        "properties": {"value": inner},
        "required": ["value"],
        "additionalProperties": False,
    }
    if "$defs" in schema:
        outer["$defs"] = schema["$defs"]
    return outer


class Walker:
    """Random walks through an engine's masks, with the token classes that steer them."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        texts = [tokenizer.decode([i]) for i in range(vocab)]
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.closers = torch.tensor([any(c in t for c in '"}]') for t in texts])
        self.short = torch.tensor([0 < len(t) <= 2 for t in texts])

    def walk(self, engine: Any, compiled: Any, rng: random.Random, limit: int) -> list[int] | None:
        """One walk's tokens, or None if it did not end within ``limit`` tokens."""
        matcher = engine.matcher(compiled)
        bitmask = torch.zeros((1, (self.vocab + 31) // 32), dtype=torch.int32)
        shifts = torch.arange(32, dtype=torch.int32)
        out: list[int] = []
        for _ in range(limit):
            engine.fill([matcher], bitmask)
            ok = ((bitmask[0].unsqueeze(1) >> shifts) & 1).view(-1)[: self.vocab].bool()
            if ok[EOS] and rng.random() < 0.7:
                return out
            ok[EOS] = False
            draw = rng.random()
            pool = ok
            if draw < 0.3 and (ok & self.closers).any():
                pool = ok & self.closers
            elif draw < 0.85 and (ok & self.short).any():
                pool = ok & self.short
            ids = pool.nonzero().view(-1)
            if len(ids) == 0:  # nothing but EOS: the document is complete
                return out
            token = int(ids[rng.randrange(len(ids))])
            if not engine.accept([matcher], [token])[0]:
                raise AssertionError(f"{engine.name} refused a token its own mask allowed")
            out.append(token)
        return None


def probe(engine: Any, walker: Walker, walks: int, seed: int = 0) -> dict[str, Any]:
    """``{"refused": [...], "walks": n, "ended": n, "invalid": [(probe, text, why)...]}``."""
    import jsonschema

    result: dict[str, Any] = {"refused": [], "walks": 0, "ended": 0, "invalid": []}
    for name, inner in PROBES:
        schema = wrap(inner)
        try:
            compiled = engine.compile(schema)
            engine.matcher(compiled)
        except Exception as exc:  # each engine has its own error types
            result["refused"].append((name, str(exc).strip().splitlines()[0][:80]))
            continue
        validator = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )
        rng = random.Random(seed)
        for _ in range(walks):
            result["walks"] += 1
            ids = walker.walk(engine, compiled, rng, limit=300)
            if ids is None:
                continue
            result["ended"] += 1
            text = walker.tokenizer.decode(ids)
            try:
                validator.validate(json.loads(text))
            except Exception as exc:  # ValueError, ValidationError, OverflowError (1e999)
                why = str(exc).splitlines()[0][:70]
                result["invalid"].append((name, text[:60], why))
    return result
