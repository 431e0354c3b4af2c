"""From a checked ``response_format`` to a grammar llguidance can run, cached per schema.

One :class:`GrammarCompiler` per engine (per tokenizer): it wraps the model's tokenizer
for llguidance once (costly for a large vocabulary: build it when the first guided
request comes, not per request) and turns each :class:`~core.wire.response_format.ResponseFormat`
into a validated :class:`Grammar`, kept in an LRU cache keyed by the format's type and
compact schema text. :meth:`GrammarCompiler.matcher` then starts a sequence's
:class:`~engine.guided.matcher.GuidedMatcher` on it (cheap).

Why llguidance (``python -m bench.grammar_choice``, docs/benchmarks.md "Grammar engine
for structured outputs"): among xgrammar, llguidance and outlines-core it is the only one
whose random walks over every probe schema all parsed and validated, and it refuses the
JSON Schema keywords it cannot enforce instead of dropping them; xgrammar filled the
batch-64 mask sooner but let raw control characters into strings with
``maxLength``; outlines-core compiled in seconds and has no batch API.

The JSON it allows is compact, on one line, with ``", "`` and ``": "`` as separators
(``GRAMMAR_OPTIONS`` of core/wire/response_format.py): no run of whitespace a small
model could get lost in. Object properties come in the schema's order. ``json_object``
is the schema ``{"type": "object"}``. A ``tool_calls`` format (a required or named tool
call, core/wire/tools.py) carries its grammar as Lark text, each call's JSON as above.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenrelay.core.wire.response_format import GRAMMAR_OPTIONS, ResponseFormat

if TYPE_CHECKING:
    from tokenrelay.engine.guided.matcher import GuidedMatcher

JSON_OBJECT_SCHEMA = '{"type":"object"}'
DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar (its JSON text) and the format it came from."""

    key: str
    text: str


class GrammarCompiler:
    """Compiles response formats for one tokenizer; thread-safe (a worker compiles
    beside the engine's loop)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """``tokenizer``: a Hugging Face fast tokenizer; ``vocab_size``: the model's
        (the logits' width); ``eos_token_ids``: every token that ends a sequence (the
        only tokens allowed once the JSON is complete).

        Raises ``ValueError`` for a tokenizer llguidance cannot read (a slow one).
        """
        import llguidance
        import llguidance.hf

        eos = sorted({int(t) for t in eos_token_ids})
        if not eos:
            raise ValueError("guided decoding needs at least one EOS token id")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=eos
            )
        except ValueError as exc:
            raise ValueError(f"response_format is not available for this model: {exc}") from exc
        self._llg = llguidance
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, fmt: ResponseFormat) -> Grammar:
        """The grammar of ``fmt``, from the cache or built and validated now.

        Raises ``ValueError`` (naming ``response_format``) for a schema llguidance
        refuses: an unimplemented keyword, an unsatisfiable or too large grammar.
        """
        with self._lock:
            grammar = self._cache.get(fmt.key)
            if grammar is not None:
                self._cache.move_to_end(fmt.key)
                self.hits += 1
                return grammar
        grammar = Grammar(fmt.key, self._build(fmt))  # outside the lock: may take ms
        with self._lock:
            self.misses += 1
            self._cache[fmt.key] = grammar
            self._cache.move_to_end(fmt.key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _build(self, fmt: ResponseFormat) -> str:
        matcher_cls = self._llg.LLMatcher
        what = "tools" if fmt.type == "tool_calls" else "response_format"
        try:
            if fmt.type == "tool_calls" and fmt.schema is not None:  # Lark (core/wire/tools.py)
                text = matcher_cls.grammar_from_lark(fmt.schema)
            elif fmt.type == "json_object" or (fmt.type == "json_schema" and fmt.schema):
                schema = fmt.schema if fmt.type == "json_schema" else JSON_OBJECT_SCHEMA
                assert schema is not None
                text = matcher_cls.grammar_from_json_schema(schema, overrides=GRAMMAR_OPTIONS)
            else:
                raise ValueError(f"cannot compile type {fmt.type!r}")
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from exc
        error = matcher_cls.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"{what}: {_first_line(error)}")
        return str(text)

    def matcher(self, fmt: ResponseFormat) -> GuidedMatcher:
        """A new sequence's matcher for ``fmt`` (compiling it if not cached)."""
        from tokenrelay.engine.guided.matcher import GuidedMatcher

        return GuidedMatcher(self.tokenizer, self.compile(fmt))

    def cache_info(self) -> dict[str, int]:
        """Entries, hits and misses of the compile cache."""
        with self._lock:
            return {"entries": len(self._cache), "hits": self.hits, "misses": self.misses}


def _first_line(message: str) -> str:
    """llguidance's errors may go on with parser state: keep the first line."""
    return message.strip().splitlines()[0] if message.strip() else message
