"""A GGUF model's tokenizer, built from the file's ``tokenizer.ggml.*`` metadata.

Two vocabularies (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE (SmolLM2, Llama 3, Qwen) from the tokens and merges. The
  pre-tokenizer is the one ``tokenizer.ggml.pre`` names (llama.cpp's name for the
  split the merges were learned on): Llama 3's and Qwen2's regular expressions,
  SmolLM's and StarCoder's single digits, else GPT-2's own split.
- ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral 7B v0.1,
  TinyLlama), the merges from the file or, as transformers derives them, from the
  tokens' scores.

Control tokens (token type 3) become special added tokens and user-defined ones (4)
plain added tokens, so they are matched whole. The result is wrapped in transformers'
``PreTrainedTokenizerFast`` with the special tokens, ``add_bos_token`` and the chat
template, and saved as ``tokenizer.json`` + ``tokenizer_config.json``: the folder
``engine/text/tokenizer.py`` loads.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from tokenrelay.engine.models.gguf_file import GGUFIndex

log = logging.getLogger("tokenrelay.model")

TOKENIZER_MODELS = ("gpt2", "llama")
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split before the byte-level step (llama.cpp's llama-vocab.cpp)
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe")
_SPLITS = {
    **dict.fromkeys(_LLAMA3_PRES, _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O),
}
_DIGITS = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"}  # digit by digit
_GPT2 = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}  # GPT-2's own split, said so
_NFC = {"qwen2", "deepseek-r1-qwen", "megrez"}  # Qwen2's tokenizer normalizes to NFC


def build_tokenizer(index: GGUFIndex, progress: Callable[[str], None] = lambda line: None) -> Any:
    """The tokenizer ``index`` describes, as a transformers ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    meta = index.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise ValueError(
            f"model: {index.path.name} has tokenizer model {kind!r}, which is not supported "
            f"(supported: {', '.join(TOKENIZER_MODELS)})"
        )
    started = time.monotonic()
    tokens: list[str] = index.array("tokenizer.ggml.tokens")
    types = _optional_array(index, "token_type") or [0] * len(tokens)
    merges = _optional_array(index, "merges")
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if kind == "gpt2":
        if merges is None:
            raise ValueError(f"model: {index.path.name} has a gpt2 tokenizer but no merges")
        tok = _byte_level(tokens, merges, pre)
        alphabet = set(_byte_alphabet().values())
        # a "control" token outside the byte alphabet is a llama.cpp mislabel (transformers)
        control = [
            t for t, k in zip(tokens, types, strict=False) if k == CONTROL and set(t) <= alphabet
        ]
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRES))
    else:
        scores = _optional_array(index, "scores")
        if merges is None and scores is None:
            raise ValueError(f"model: {index.path.name} has a llama tokenizer but no scores")
        space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok = _sentencepiece(tokens, merges, scores or [], space)
        control = [t for t, k in zip(tokens, types, strict=False) if k == CONTROL]
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab()
    user = [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    n_merges = len(merges) if merges is not None else "derived"
    progress(
        f"tokenizer: {kind} ({pre}), {len(tokens)} tokens, {n_merges} merges "
        f"({time.monotonic() - started:.1f} s)"
    )

    def named(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if isinstance(token_id, int) and token_id < len(tokens) else None

    extra: dict[str, Any] = {}
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        extra["chat_template"] = template
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=named("bos"),
        eos_token=named("eos"),
        unk_token=named("unknown"),
        pad_token=named("padding"),
        add_bos_token=add_bos,
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        **extra,
    )


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` (with ``add_bos_token`` and
    ``add_eos_token`` said, which transformers leaves out) and the chat template."""
    tokenizer.save_pretrained(str(out))
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["add_bos_token"] = bool(tokenizer.add_bos_token)
    config["add_eos_token"] = bool(tokenizer.add_eos_token)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _optional_array(index: GGUFIndex, name: str) -> list[Any] | None:
    key = f"tokenizer.ggml.{name}"
    return index.array(key) if key in index.arrays else None


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's spelling of each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelled = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in spelled)
    spelled.update({b: chr(256 + n) for n, b in enumerate(others)})
    return spelled


def _byte_level(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    """Byte-level BPE over ``tokens`` and ``merges`` with the split ``pre`` names."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    pairs = _pairs(merges)
    # Llama 3 takes a word that is a token whole before merging (llama.cpp, its tokenizer.json)
    whole = pre in _LLAMA3_PRES
    bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=whole)
    tok = Tokenizer(bpe)
    split = _SPLITS.get(pre)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in _DIGITS and pre not in _GPT2:
            log.warning("tokenizer.ggml.pre %r is not known here: GPT-2's split is used", pre)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        digits = [pre_tokenizers.Digits(individual_digits=True)] if pre in _DIGITS else []
        tok.pre_tokenizer = pre_tokenizers.Sequence([*digits, byte_level]) if digits else byte_level
    if pre in _NFC:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(
    tokens: list[str], merges: list[str] | None, scores: list[float], add_space_prefix: bool
) -> Tokenizer:
    """SentencePiece BPE: ``▁`` for spaces, bytes the vocabulary lacks as ``<0xNN>``."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is not None:
        pairs = _pairs(merges)
    else:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=False)))
    unk = "<unk>" if "<unk>" in vocab else None
    bpe = models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    scheme = "first" if add_space_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _pairs(merges: list[str]) -> list[tuple[str, str]]:
    """``"a b"`` -> ``("a", "b")`` (a token never holds a space: it is spelled ``Ġ`` or ``▁``)."""
    return [(left, right) for left, _, right in (m.partition(" ") for m in merges)]


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scored merged token first (as
    transformers' ``generate_merges`` orders them)."""
    found: list[tuple[str, str, float]] = []
    for merged, score in scores.items():
        local = [
            (merged[:i], merged[i:], score)
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
