"""From a checked ``response_format`` to a grammar llguidance can run, cached per schema.

One :class:`GrammarCompiler` per engine (per tokenizer): it wraps the model's tokenizer
for llguidance once (costly for a large vocabulary: build it when the first guided
request comes, not per request) and turns each :class:`~core.wire.response_format.ResponseFormat`
into a validated :class:`Grammar`, kept in an LRU cache keyed by the format's type and
compact schema text. :meth:`GrammarCompiler.matcher` then starts a sequence's
:class:`~engine.guided.matcher.GuidedMatcher` on it: llguidance builds a matcher's parser
and lexer when it starts one, which costs as much as the compile again, so the cache also
keeps one matcher per grammar, never advanced, and each sequence gets a copy of it (tens
of microseconds): the ``n`` choices of a request, or the requests that share a schema,
compile it once. Both may take seconds for a large schema: a worker calls them on its
preparer thread, off the engine's step loop (worker/prepare.py), and llguidance releases
the GIL meanwhile.

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

from tokenrelay.core.wire.params import SamplingParams
from tokenrelay.core.wire.response_format import GRAMMAR_OPTIONS, ResponseFormat
from tokenrelay.core.wire.vocabulary import ToolFormat

if TYPE_CHECKING:
    from tokenrelay.engine.guided.matcher import GuidedMatcher

JSON_OBJECT_SCHEMA = '{"type":"object"}'
DEFAULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar (its JSON text) and the format it came from."""

    key: str
    text: str


@dataclass
class _Entry:
    """A cached grammar and, once a sequence asked for it, its matcher at the start."""

    grammar: Grammar
    start: GuidedMatcher | None = None


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
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the counters
        self._build_lock = threading.Lock()  # one build at a time: the next one may hit
        self.hits = 0
        self.misses = 0  # grammars compiled

    def compile(self, fmt: ResponseFormat) -> Grammar:
        """The grammar of ``fmt``, from the cache or built and validated now.

        Raises ``ValueError`` (naming ``response_format``) for a schema llguidance
        refuses: an unimplemented keyword, an unsatisfiable or too large grammar.
        """
        return self._entry(fmt).grammar

    def _cached(self, key: str) -> _Entry | None:
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            return entry

    def _entry(self, fmt: ResponseFormat) -> _Entry:
        """The cache entry of ``fmt``, compiled now if it is not cached (one build at a
        time, outside the cache's lock: a thread that waited for the same grammar hits)."""
        entry = self._cached(fmt.key)
        if entry is not None:
            return entry
        with self._build_lock:
            entry = self._cached(fmt.key)
            if entry is not None:
                return entry
            entry = _Entry(Grammar(fmt.key, self._build(fmt)))
            with self._lock:
                self.misses += 1
                self._cache[fmt.key] = entry
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return entry

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
        """A new sequence's matcher for ``fmt``: a copy of the cached one at the grammar's
        start (compiling the grammar and starting that one first if not cached)."""
        from tokenrelay.engine.guided.matcher import GuidedMatcher

        entry = self._entry(fmt)
        start = entry.start
        if start is None:
            with self._build_lock:
                if entry.start is None:  # llguidance builds the parser: as costly as a compile
                    entry.start = GuidedMatcher(self.tokenizer, entry.grammar)
                start = entry.start
        return start.fork()

    def cache_info(self) -> dict[str, int]:
        """Entries, hits and misses of the compile cache."""
        with self._lock:
            return {"entries": len(self._cache), "hits": self.hits, "misses": self.misses}


class EngineGrammars:
    """An engine's :class:`GrammarCompiler`, built by its first guided request (about a
    second for a large vocabulary) in whichever thread asks first; thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._args = (tokenizer, vocab_size, eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler (built now if this is the first call)."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
            return self._compiler

    def for_request(
        self,
        params: SamplingParams,
        guide: GuidedMatcher | None = None,
        tool_format: ToolFormat = ToolFormat.HERMES,
    ) -> GuidedMatcher | None:
        """The grammar state a new request starts in (``None``: free text): ``guide``, a
        matcher made ahead for its format (:meth:`GrammarCompiler.matcher`), else a new one.

        Raises ``ValueError`` for a grammar refused here, a ``guide`` of another grammar,
        or a guided request with ``ignore_eos``.
        """
        fmt = params.guided_for(tool_format)
        if fmt is None:
            if guide is not None:
                raise ValueError("guide: the request has no response_format")
            return None
        if params.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with a response_format")
        if guide is None:
            return self.compiler.matcher(fmt)
        if guide.grammar.key != fmt.key:
            raise ValueError("guide: made for another response_format")
        return guide


def _first_line(message: str) -> str:
    """llguidance's errors may go on with parser state: keep the first line."""
    return message.strip().splitlines()[0] if message.strip() else message
