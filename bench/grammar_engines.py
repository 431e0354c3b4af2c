"""The three grammar engines behind one small interface, and the documents they walk.

Used by ``python -m bench.grammar_choice`` (timing) and ``bench/grammar_probes.py``
(validity). Each adapter wraps one engine as the engine's own documentation drives it
with a Hugging Face tokenizer: ``compile`` a JSON schema, start a ``matcher``, ``fill``
a batch's ``[rows, ceil(V/32)]`` int32 bitmask with the engine's batch API where it has
one, ``accept`` one token per matcher. All three allow the same JSON: compact, one
line, ``", "`` and ``": "`` as separators (what ``json.dumps`` writes).
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
        "scores": {"type": "array", "items": {"type": "integer"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
        "note": {"type": "string"},  # escapes: see the module docstring
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}
JSON_OBJECT: dict[str, Any] = {"type": "object"}
EOS = 2  # SmolLM2's <|im_end|>, the tokenizer's and the generation config's EOS

WORDS = ["Ann", "Bo", "Chloé", "Dmitri", "Émile", "Fatima", "Gus", "Hana", "Ivo", "Zoë"]
STREETS = ["1 Rue de la Paix", "22 Baker Street", "Hauptstraße 5", "3-1 Marunouchi", "Main St"]
CITIES = ["Paris", "London", "Berlin", "Tōkyō", "New York", "Zürich"]


def schema_doc(rng: random.Random) -> dict[str, Any]:
    """A random document valid against :data:`SCHEMA`, keys in the declared order."""
    address: dict[str, Any] = {"street": rng.choice(STREETS), "city": rng.choice(CITIES)}
    if rng.random() < 0.5:
        address["country"] = rng.choice(["FR", "DE", "US", "JP"])
    doc: dict[str, Any] = {
        "name": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))),
        "age": rng.randint(0, 120),
        "role": rng.choice(["admin", "editor", "viewer", "guest"]),
        "scores": [rng.randint(-50, 1000) for _ in range(rng.randint(0, 8))],
        "address": address,
    }
    if rng.random() < 0.5:
        doc["active"] = rng.random() < 0.5
    if rng.random() < 0.5:
        doc["note"] = f'says "{rng.choice(WORDS)}"\tand {rng.randint(1, 99)}%'
    return doc


def object_doc(rng: random.Random) -> dict[str, Any]:
    """A random JSON object: nesting, floats, null, escapes, non-ASCII text."""
    if rng.random() < 0.5:
        return schema_doc(rng)
    return {
        "id": rng.randint(1, 10**6),
        "ratio": round(rng.uniform(-10, 10), 3),
        "tags": [rng.choice(WORDS) for _ in range(rng.randint(0, 4))],
        "meta": {"ok": rng.random() < 0.5, "parent": None, "path": "a\\b\n"},
        "matrix": [[rng.randint(0, 9) for _ in range(2)] for _ in range(rng.randint(0, 3))],
    }


def documents(kind: str, tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """``count`` token sequences of valid documents (``json.dumps``' separators)."""
    rng = random.Random(seed)
    make = schema_doc if kind == "schema" else object_doc
    out = []
    for _ in range(count):
        text = json.dumps(make(rng), ensure_ascii=False)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


# ------------------------------------------------------------------ engine adapters
class Xgrammar:
    """xgrammar: a compiler with its own cache; batched fill over threads."""

    name = "xgrammar"
    modules = ("xgrammar",)

    def __init__(self, tokenizer: Any, vocab: int, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab = vocab
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[EOS]
        )
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.threads = threads
        self.compiler = self.new_compiler()

    def new_compiler(self) -> Any:
        return self.xgr.GrammarCompiler(self.info, max_threads=self.threads)

    def compile(self, schema: dict[str, Any], compiler: Any = None) -> Any:
        strict = schema is not JSON_OBJECT  # json_object: any properties allowed
        return (compiler or self.compiler).compile_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=strict
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def cold(self, schema: dict[str, Any]) -> Any:
        return self.compile(schema, self.new_compiler())

    def cached(self, schema: dict[str, Any], compiled: Any) -> Any:
        return self.compile(schema)  # the long-lived compiler's cache


class Llguidance:
    """llguidance: no compiled artifact (a grammar string; the matcher builds lazily)."""

    name = "llguidance"
    modules = ("llguidance", "llguidance.hf", "llguidance.torch")
    OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self, tokenizer: Any, vocab: int, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.vocab = vocab
        self.lltorch = llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=EOS)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict[str, Any]) -> str:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides=self.OPTIONS
        )
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    cold = compile

    def cached(self, schema: dict[str, Any], compiled: str) -> str:
        return compiled  # kept by the caller: no compile cache in llguidance

    def matcher(self, compiled: str) -> Any:
        m = self.llg.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.lltorch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return self.executor.consume_token_par(list(zip(matchers, tokens, strict=True)))


class OutlinesCore:
    """outlines-core: a regex DFA over the vocabulary (``Index``); no batch API."""

    name = "outlines-core"
    modules = ("outlines_core", "transformers.convert_slow_tokenizer")

    def __init__(self, tokenizer: Any, vocab: int, threads: int) -> None:
        import outlines_core
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.oc = outlines_core
        self.vocab = vocab
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        special = set(tokenizer.all_special_tokens)
        table: dict[bytes, list[int]] = {}
        for text, token in tokenizer.get_vocab().items():
            if text not in special and token < vocab:
                table.setdefault(bytes(to_byte[c] for c in text), []).append(token)
        self.vocabulary = outlines_core.Vocabulary(EOS, table)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    cold = compile

    def cached(self, schema: dict[str, Any], compiled: Any) -> Any:
        return compiled  # the Index, kept by the caller

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        words = bitmask.shape[1]
        base, row = bitmask.data_ptr(), words * 4
        for i, guide in enumerate(matchers):
            guide.write_mask_into(base + i * row, words, 4)

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        ok = []
        for guide, token in zip(matchers, tokens, strict=True):
            if token == EOS:  # a Guide ends in a final state; it has no move on EOS
                ok.append(guide.is_finished())
                continue
            try:
                guide.advance(token, return_tokens=False)
                ok.append(True)
            except ValueError:
                ok.append(False)
        return ok


ENGINES: dict[str, Any] = {
    "xgrammar": Xgrammar,
    "llguidance": Llguidance,
    "outlines-core": OutlinesCore,
}
