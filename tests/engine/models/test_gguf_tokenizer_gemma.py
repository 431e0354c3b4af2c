"""Gemma's own SentencePiece vocabulary from a GGUF file, through our reader
(engine/models/gguf_tokenizer.py, called by gguf_meta.write_metadata).

llama.cpp's converter (``Gemma2Model`` / ``Gemma3Model.set_vocab``) writes Gemma's
``tokenizer.model`` as ``tokenizer.ggml.model`` ``llama``: every piece with its score
and type, the entries of ``added_tokens_decoder`` scored -1000 as control (``<pad>``,
``<eos>``, ``<bos>``, ``<mask>``, ``<unused0>``, ``<start_of_turn>``, ``<end_of_turn>``)
or user-defined (runs of newlines, runs of spaces respelled from ``▁▁`` with real
spaces, HTML tags), the 256 byte pieces ``<0x00>``..``<0xFF>``, no merges,
``add_space_prefix`` false, ``add_bos_token`` true, the chat template, and no end-of-turn
id. The file here is a small vocabulary of that layout: merged pieces first, best-scored
first, then the single characters, as SentencePiece orders them; capitals and digits are
not among them, so they fall back to bytes as non-ASCII text does.

Two references tokenize the same file: transformers' GGUF loader (its Gemma builder),
and llama.cpp's SentencePiece algorithm written out here (``llama_cpp_spm``).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import gguf
import pytest

from tests.engine.models.test_gguf_gemma import _header
from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.gguf_meta import write_metadata
from tokenrelay.engine.text.chat import render_chat
from tokenrelay.engine.text.detokenizer import IncrementalDetokenizer
from tokenrelay.engine.text.tokenizer import load_tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6  # tokenizer.ggml.token_type
HEAD = [
    ("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
    ("<mask>", CONTROL), ("<unused0>", CONTROL), ("<start_of_turn>", CONTROL),
    ("<end_of_turn>", CONTROL), ("\n", USER_DEFINED), ("\n\n", USER_DEFINED),
    ("  ", USER_DEFINED), ("   ", USER_DEFINED), ("<table>", USER_DEFINED),
]  # fmt: skip
PAD, EOS, BOS, END_OF_TURN = 0, 1, 2, 7
MERGED = [
    "▁t", "he", "▁the", "in", "er", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁he",
    "▁hell", "▁hello", "hell", "hello", "od", "el", "mod", "model", "▁model", "ing", "▁s",
    "ea", "▁sea", "▁se", "▁sell", "▁sells", "us", "user", "▁user", "▁a", "an", "▁an",
]  # fmt: skip
CHARS = list("▁abcdefghijklmnopqrstuvwxyz,.!?'()=+*/<>")
TOKENS = [t for t, _ in HEAD] + [f"<0x{b:02X}>" for b in range(256)] + MERGED + CHARS
TYPES = [k for _, k in HEAD] + [BYTE] * 256 + [NORMAL] * (len(MERGED) + len(CHARS))
SCORES = [-1000.0] * len(HEAD) + [0.0] * 256 + [-float(i) for i in range(len(MERGED + CHARS))]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TEXTS = [
    "hello world",
    " hello the world",
    "  two spaces lead",
    "trailing two  ",
    "a   three",
    "the\nmodel\n\n\nsells",
    "tab\tand\r\nreturn",
    "Hello World 2024",
    "naïve café",
    "日本語 😀 👍🏽",
    "<start_of_turn>user\nhello<end_of_turn>\n",
    "<bos><eos><pad>",
    "<table>the sea</table>",
    "<unused0>",
    "",
    " ",
    "x = f(y) + 2*z.",
    "she sells, sea?",
    "hello , world .",
]
MESSAGES = [
    {"role": "user", "content": "hello the world"},
    {"role": "assistant", "content": "the model sells"},
    {"role": "user", "content": "  an user\n\nsea?  "},
]


def write_vocab(w: gguf.GGUFWriter, add_bos: bool | None = True) -> int:
    """The tokenizer keys as llama.cpp's converter writes a Gemma file's; ``add_bos`` None:
    no ``add_bos_token`` key. Returns the vocabulary's size."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores(SCORES)
    w.add_token_types(TYPES)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_unk_token_id(3)
    w.add_pad_token_id(PAD)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    w.add_chat_template(TEMPLATE)
    w.add_add_space_prefix(False)
    return len(TOKENS)


def write_gemma(folder: Path, arch: str, add_bos: bool | None = True) -> Path:
    """A ``arch`` header with the Gemma vocabulary, at ``folder/<arch>.gguf``."""

    def keys(w: gguf.GGUFWriter) -> int:
        if arch == "gemma3":  # a uint32, as the converter writes it (transformers checks)
            w.add_sliding_window(512)
        return write_vocab(w, add_bos)

    folder.mkdir(parents=True, exist_ok=True)
    return _header(folder / f"{arch}.gguf", arch, 2, tokenizer=keys)


def llama_cpp_spm(text: str, add_bos: bool = True) -> list[int]:
    """llama.cpp's SentencePiece tokenization of ``text`` (llama-vocab.cpp, add_space_prefix
    false): control and user-defined tokens split off first, longest first; in the rest
    spaces become ``▁`` and the adjacent pair whose union is the best-scored token merges,
    leftmost on a tie, until none is a token; a character outside the vocabulary is its
    UTF-8 bytes."""
    ids = {t: i for i, t in enumerate(TOKENS)}
    whole = sorted((t for t, k in HEAD if k in (CONTROL, USER_DEFINED)), key=len, reverse=True)
    out = [BOS] if add_bos else []
    parts = re.split("(" + "|".join(map(re.escape, whole)) + ")", text)
    for n, part in enumerate(parts):
        if n % 2:  # a special token, matched whole
            out.append(ids[part])
            continue
        symbols = list(part.replace(" ", "▁"))
        while True:
            pairs = [
                (SCORES[ids[a + b]], -i)
                for i, (a, b) in enumerate(itertools.pairwise(symbols))
                if a + b in ids
            ]
            if not pairs:
                break
            i = -max(pairs)[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            out.extend([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])
    return out


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(meta folder, our tokenizer, transformers' tokenizer)`` of a Gemma file."""
    from transformers import AutoTokenizer

    path = write_gemma(tmp_path_factory.mktemp("gguf"), request.param)
    meta = path.parent / "meta"
    write_metadata(path, meta)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return meta, load_tokenizer(meta), ref  # ours through the engine's own loader


def test_gemma_text_tokenizes_as_llama_cpp_and_transformers(gemma: Any) -> None:
    _, ours, ref = gemma
    assert ours.get_vocab() == {t: i for i, t in enumerate(TOKENS)}
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<bos>", "<eos>", "<pad>")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == llama_cpp_spm(text), text
        assert ids == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == llama_cpp_spm(text, False), text
        assert ours.decode(ids) == ref.decode(ids) == "<bos>" + text, text
        plain = ours.decode(ids, skip_special_tokens=True)
        assert plain == ref.decode(ids, skip_special_tokens=True), text
        stream = IncrementalDetokenizer(ours)  # the engine's, a token at a time
        assert "".join(stream.add(i) for i in ids) + stream.flush() == plain, text
    # no space prefix; a run of spaces or newlines is its user-defined token
    assert ours.encode("hello", add_special_tokens=False) == [TOKENS.index("hello")]
    assert ours.encode("a   b\n\n", add_special_tokens=False) == [
        TOKENS.index(t) for t in ("a", "   ", "b", "\n\n")
    ]
    bytes_of_e = [TOKENS.index("<0xC3>"), TOKENS.index("<0xA9>")]  # é is not a piece
    assert ours.encode("é", add_special_tokens=False) == bytes_of_e


def test_the_chat_template_renders_one_bos_and_whole_turn_markers(gemma: Any) -> None:
    _, ours, ref = gemma
    assert ours.chat_template == TEMPLATE
    text = render_chat(ours, MESSAGES)  # the engine's rendering, its generation prompt
    assert text == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos><start_of_turn>user\nhello the world<end_of_turn>\n")
    assert text.endswith("<end_of_turn>\n<start_of_turn>model\n")
    ids = ours(text, add_special_tokens=False).input_ids  # as LLMEngine.apply_chat_template
    assert ids == llama_cpp_spm(text.removeprefix("<bos>"))
    assert ids == ref(text, add_special_tokens=False).input_ids
    assert ids.count(BOS) == 1 and ids.count(END_OF_TURN) == 3 and ids.count(6) == 4


def test_end_of_turn_stops_generation_beside_eos(gemma: Any) -> None:
    """The file names no eot id: ``<end_of_turn>`` is found by its text, as llama.cpp does
    (and as Gemma's own generation configs list it beside ``<eos>``)."""
    meta, _, _ = gemma
    gen = json.loads((meta / "generation_config.json").read_text())
    assert gen == {"bos_token_id": BOS, "eos_token_id": [EOS, END_OF_TURN], "pad_token_id": PAD}
    cfg = ModelConfig.from_pretrained(meta)
    assert cfg.eos_token_ids == {EOS, END_OF_TURN} and cfg.bos_token_id == BOS


@pytest.mark.parametrize(("add_bos", "first"), [(None, [BOS]), (False, [])])
def test_bos_follows_the_file_and_llama_cpps_default(
    add_bos: bool | None, first: list[int], tmp_path: Path
) -> None:
    """No ``add_bos_token`` key: a SentencePiece vocabulary adds BOS (llama.cpp's default)."""
    path = write_gemma(tmp_path, "gemma2", add_bos=add_bos)
    write_metadata(path, tmp_path / "meta")
    ours = load_tokenizer(tmp_path / "meta")
    assert ours.encode("hello world") == first + llama_cpp_spm("hello world", add_bos=False)
    config = json.loads((tmp_path / "meta" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is (add_bos is None)
