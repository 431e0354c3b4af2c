"""engine/guided/compiler.py: response formats to llguidance grammars, cached, errors named."""

from __future__ import annotations

from typing import Any

import pytest

from tokenrelay.core.wire.response_format import ResponseFormat, parse_response_format
from tokenrelay.engine.guided.compiler import GrammarCompiler


def json_schema(schema: dict[str, Any]) -> ResponseFormat:
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    assert fmt is not None
    return fmt


def test_compiles_json_object_and_schemas(compiler: GrammarCompiler) -> None:
    for fmt in (
        ResponseFormat("json_object"),
        json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
        json_schema({"type": "array", "items": {"enum": [1, "x", None]}, "maxItems": 3}),
    ):
        grammar = compiler.compile(fmt)
        assert grammar.key == fmt.key and grammar.text
        assert compiler.matcher(fmt).grammar is grammar


def test_the_cache_is_keyed_by_schema_and_bounded(tokenizer: Any) -> None:
    small = GrammarCompiler(tokenizer, 49152, [2], cache_size=2)
    a = json_schema({"type": "integer"})
    b = json_schema({"type": "string"})
    c = json_schema({"type": "boolean"})
    first = small.compile(a)
    assert small.compile(json_schema({"type": "integer"})) is first  # same text: a hit
    assert small.cache_info() == {"entries": 1, "hits": 1, "misses": 1}
    small.compile(b)
    small.compile(a)  # a becomes the most recent
    small.compile(c)  # evicts b
    assert small.cache_info() == {"entries": 2, "hits": 2, "misses": 3}
    assert small.compile(a) is first
    small.compile(b)
    assert small.cache_info()["misses"] == 4


def test_schemas_llguidance_refuses_are_value_errors(compiler: GrammarCompiler) -> None:
    # the gateway's checks would refuse these first; the engine must refuse them too
    for schema, words in [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "string", "format": "iri"}, "iri"),
    ]:
        with pytest.raises(ValueError, match=words) as info:
            compiler.compile(ResponseFormat("json_schema", __import__("json").dumps(schema)))
        assert str(info.value).startswith("response_format: ")
        assert "\n" not in str(info.value)


def test_unsatisfiable_schemas_are_value_errors(compiler: GrammarCompiler) -> None:
    with pytest.raises(ValueError, match="response_format"):
        compiler.matcher(json_schema({"type": "string", "minLength": 5, "maxLength": 2}))


def test_bad_construction(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="EOS"):
        GrammarCompiler(tokenizer, 49152, [])
    with pytest.raises(ValueError, match="cache_size"):
        GrammarCompiler(tokenizer, 49152, [2], cache_size=0)
    with pytest.raises(ValueError, match="cannot compile"):
        GrammarCompiler(tokenizer, 49152, [2]).compile(ResponseFormat("json_schema"))


def test_the_matchers_of_one_format_come_from_one_compile(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``n`` choices (or requests sharing a schema) compile it once and start llguidance's
    matcher once: each sequence gets a copy of the cached start, in its own state."""
    from tokenrelay.engine.guided import matcher as matcher_module

    started: list[str] = []
    real_init = matcher_module.GuidedMatcher.__init__

    def counted(self: Any, tok: Any, grammar: Any, *, _matcher: Any = None) -> None:
        started.append(grammar.key)
        real_init(self, tok, grammar, _matcher=_matcher)

    monkeypatch.setattr(matcher_module.GuidedMatcher, "__init__", counted)
    own = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    fmt = json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    first, second, third = (own.matcher(fmt) for _ in range(3))
    assert own.cache_info()["misses"] == 1 and len(started) == 1
    for token in tokenizer('{"a": 1}', add_special_tokens=False)["input_ids"]:
        assert first.accept(token)
    assert first.stopped and not second.stopped and not third.stopped
    assert second.grammar is third.grammar is own.compile(fmt)


def test_engine_grammars_take_a_guide_made_ahead(tokenizer: Any) -> None:
    from tokenrelay.core.wire.params import SamplingParams
    from tokenrelay.engine.guided.compiler import EngineGrammars

    grammars = EngineGrammars(tokenizer, 49152, [tokenizer.eos_token_id])
    schema = {"type": "object", "properties": {"b": {"type": "string"}}}
    params = SamplingParams(response_format={"type": "json_schema",
                                             "json_schema": {"schema": schema}})  # fmt: skip
    assert params.guided is not None
    guide = grammars.compiler.matcher(params.guided)
    assert grammars.for_request(params, guide) is guide
    fresh = grammars.for_request(params)
    assert fresh is not None and fresh is not guide and fresh.grammar is guide.grammar
    other = grammars.compiler.matcher(ResponseFormat("json_object"))
    with pytest.raises(ValueError, match="another response_format"):
        grammars.for_request(params, other)
    with pytest.raises(ValueError, match="no response_format"):
        grammars.for_request(SamplingParams(), guide)
    assert grammars.for_request(SamplingParams()) is None
