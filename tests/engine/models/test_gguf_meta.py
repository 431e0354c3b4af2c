"""engine/models/gguf_meta.py and gguf_tokenizer.py: a GGUF model's config and tokenizer
from the file's own metadata, checked against transformers' GGUF conversion.

transformers serves as the reference here only: the engine never calls it on a GGUF
file to prepare a model. SmolLM2's split (``tokenizer.ggml.pre`` = ``smollm``) takes
digits one by one, as llama.cpp and the model's own tokenizer.json do; transformers'
conversion does not, which shows only where a non-ASCII numeral follows a space
(the vocabulary has no token of two digits).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenrelay.engine.models.config import ModelConfig
from tokenrelay.engine.models.gguf_file import GGUFIndex
from tokenrelay.engine.models.gguf_meta import model_config, write_metadata
from tokenrelay.engine.models.gguf_tokenizer import build_tokenizer
from tokenrelay.engine.models.store import default_gguf_path, resolve_gguf
from tokenrelay.engine.text.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "   leading and trailing   ",
    "a\tb\t\tc",
    "\n\n\nthree newlines\r\n",
    "naïve café Straße Ångström",
    "日本語のテキストと中文",
    "Привет, мир",
    "مرحبا بالعالم",
    "e\u0301 combining accent",
    "emoji 😀🎉👍🏽 👨‍👩‍👧 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a && b) { return -1; }\n\treturn 0;",
    "3.14159 1,234,567 2024-12-05 007 x² + y³",
    "I'm sure they'll've done it, don't you?",
    "https://example.com/path?q=1&r=2",
    "tabs\t\t\tand    spaces\u00a0nbsp\u2003em",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|>",
]
MESSAGES = [
    {"role": "user", "content": "What is 2+2? 😀"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks!\n\n  Bye."},
]


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """transformers' config and tokenizer of the default model's GGUF file."""
    from transformers import AutoConfig, AutoTokenizer

    gguf = default_gguf_path()
    folder, name = str(gguf.parent), gguf.name
    return AutoConfig.from_pretrained(folder, gguf_file=name), AutoTokenizer.from_pretrained(
        folder, gguf_file=name
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's metadata folder, as resolve_gguf writes it."""
    out = tmp_path_factory.mktemp("meta") / "SmolLM2.meta"
    write_metadata(default_gguf_path(), out)
    return out


def test_the_tokenizer_encodes_and_decodes_as_transformers(
    prepared: Path, reference: tuple[Any, Any]
) -> None:
    ref = reference[1]
    ours = load_tokenizer(prepared)  # through the engine's own loader
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.added_tokens_decoder == ref.added_tokens_decoder
    assert ours.all_special_ids == ref.all_special_ids
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids) == text, text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )
    assert ours.chat_template == ref.chat_template
    prompt = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert ours.encode(prompt) == ref.encode(prompt)
    assert ours.encode(prompt)[0] == ours.convert_tokens_to_ids("<|im_start|>")


def test_digits_are_split_one_by_one_as_smollm_was_trained(prepared: Path) -> None:
    """``smollm``: a numeral is its own piece (llama.cpp; the model's tokenizer.json)."""
    ours = load_tokenizer(prepared)
    for pieces in ([" ", "½"], [" ", "٣", "٤"], ["a", " ", "1", "2", "3", "4", "5"]):
        want = [i for piece in pieces for i in ours.encode(piece)]
        assert ours.encode("".join(pieces)) == want, pieces


def test_the_config_is_transformers_for_every_field_the_engine_reads(
    prepared: Path, reference: tuple[Any, Any]
) -> None:
    from transformers import GenerationConfig

    ref_config = reference[0]
    ref_gen = GenerationConfig.from_model_config(ref_config).to_dict()
    want = ModelConfig.from_dict(ref_config.to_dict(), ref_gen)
    assert ModelConfig.from_pretrained(prepared) == want
    cfg = json.loads((prepared / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        assert cfg[key] == getattr(ref_config, key), key
    assert cfg["torch_dtype"] == "float32"
    tok_config = json.loads((prepared / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is False and tok_config["eos_token"] == "<|im_end|>"


def test_the_token_arrays_are_read_on_request_and_fast() -> None:
    index = GGUFIndex(default_gguf_path())
    assert "tokenizer.ggml.tokens" not in index.metadata
    assert index.arrays["tokenizer.ggml.tokens"].count == 49152
    started = time.monotonic()
    tokens = index.array("tokenizer.ggml.tokens")
    merges = index.array("tokenizer.ggml.merges")
    types = index.array("tokenizer.ggml.token_type")
    assert time.monotonic() - started < 1.0
    assert (len(tokens), len(merges), len(types)) == (49152, 48900, 49152)
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert merges[0] == "Ġ t" and types[:3] == [3, 3, 3] and set(types) == {1, 3}


def _tiny(path: Path, arch: str = "llama", model: str = "gpt2", **extra: Any) -> Path:
    """A small GGUF file: hyperparameters, a tokenizer, one embedding tensor."""
    gg = pytest.importorskip("gguf")
    w = gg.GGUFWriter(str(path), arch)
    for key, value in [("block_count", 2), ("embedding_length", 16), ("context_length", 64)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_uint32(f"{arch}.feed_forward_length", 32)
    w.add_uint32(f"{arch}.attention.head_count", 2)
    w.add_uint32(f"{arch}.attention.head_count_kv", 1)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 500000.0)
    for key, value in extra.get("floats", {}).items():
        w.add_float32(f"{arch}.{key}", value)
    if "rope_type" in extra:
        w.add_string(f"{arch}.rope.scaling.type", extra["rope_type"])
    w.add_tokenizer_model(model)
    tokens = extra.get("tokens", ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab"])
    w.add_token_list(tokens)
    w.add_token_types(extra.get("types", [3, 3] + [1] * (len(tokens) - 2)))
    if "scores" in extra:
        w.add_token_scores(extra["scores"])
    else:
        w.add_token_merges(["a b", "Ġ ab"])
    w.add_bos_token_id(extra.get("bos", 0))
    w.add_eos_token_id(extra.get("bos", 0) + 1)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 16), np.float32))
    if "rope_freqs" in extra:
        w.add_tensor("rope_freqs.weight", np.asarray(extra["rope_freqs"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unsupported_architecture_is_one_clear_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _tiny(tmp_path / "bloom.gguf", arch="bloom")
    with pytest.raises(ValueError, match=r"'bloom'.*supported: llama, mistral, .*, gemma3\)$"):
        model_config(GGUFIndex(path))
    monkeypatch.setenv("TOKENRELAY_HOME", str(tmp_path / "home"))
    with pytest.raises(ValueError, match="architecture 'bloom'"):
        resolve_gguf(str(path))
    assert [p.name for p in (tmp_path / "home" / "models").iterdir() if p.is_dir()] == []


def test_an_unknown_tokenizer_model_is_one_clear_line(tmp_path: Path) -> None:
    index = GGUFIndex(_tiny(tmp_path / "bert.gguf", model="bert"))
    with pytest.raises(ValueError, match=r"tokenizer model 'bert'.*supported: gpt2, llama\)$"):
        build_tokenizer(index)


def test_a_tiny_file_gives_its_config_and_tokenizer(tmp_path: Path) -> None:
    index = GGUFIndex(_tiny(tmp_path / "tiny.gguf", arch="qwen3"))
    cfg = model_config(index)
    assert cfg["model_type"] == "qwen3" and cfg["vocab_size"] == 7
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]) == (1, 8, 500000.0)
    assert cfg["tie_word_embeddings"] is True and "rope_scaling" not in cfg
    tok = build_tokenizer(index)
    assert tok.encode("ab ab<s>") == [4, 6, 0]
    assert tok.decode([4, 6, 0]) == "ab ab<s>" and tok.bos_token == "<s>"


def test_rope_scaling_comes_from_the_keys_or_llama3s_rope_freqs(tmp_path: Path) -> None:
    yarn = _tiny(
        tmp_path / "yarn.gguf",
        rope_type="yarn",
        floats={"rope.scaling.factor": 4.0, "rope.scaling.yarn_beta_fast": 16.0},
    )
    assert model_config(GGUFIndex(yarn))["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 16.0,
    }
    # llama.cpp's divisors for Llama 3 (factor 32, head_dim 8, theta 500000): 1, ..., 32
    freqs = 1.0 / 500000.0 ** (np.arange(0, 8, 2) / 8)
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1) / 3
    divisors = np.where(
        wavelen < 2048, 1.0, np.where(wavelen > 8192, 32.0, 1 / ((1 - smooth) / 32 + smooth))
    )
    llama3 = model_config(GGUFIndex(_tiny(tmp_path / "l3.gguf", rope_freqs=divisors)))
    assert llama3["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    other = _tiny(tmp_path / "other.gguf", rope_freqs=divisors * 1.5)
    with pytest.raises(ValueError, match="other than Llama 3's"):
        model_config(GGUFIndex(other))


def test_a_sentencepiece_vocabulary_tokenizes_as_transformers(tmp_path: Path) -> None:
    """``llama`` (Llama 2, Mistral 7B): merges derived from the scores, byte fallback."""
    from transformers import AutoTokenizer

    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello"]
    words += ["▁w", "or", "▁wor", "ld", "▁world", "▁t", "t", "é", "▁é"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *words]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    path = _tiny(
        tmp_path / "spm.gguf", "llama", "llama", tokens=tokens, types=types, scores=scores, bos=1
    )
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = build_tokenizer(GGUFIndex(path))
    for text in ["hello world", " hello", "hello  world", "héllo wörld", "t\n t", "", "日本"]:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids, text
        assert ids[0] == 1 and ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True
        )


def test_arrays_of_every_kind_decode_as_written(tmp_path: Path) -> None:
    gg = pytest.importorskip("gguf")
    path = tmp_path / "arrays.gguf"
    w = gg.GGUFWriter(str(path), "llama")
    w.add_array("x.nested", [["a", "bc"], ["dé"]])
    w.add_array("x.bools", [True, False, True])
    w.add_array("x.floats", [0.5, -2.0])
    w.add_uint32("x.after", 7)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    index = GGUFIndex(path)
    assert index.array("x.nested") == [["a", "bc"], ["dé"]]
    assert index.array("x.bools") == [True, False, True]
    assert index.array("x.floats") == [0.5, -2.0]
    assert index.metadata["x.after"] == 7 and "x.nested" not in index.metadata
    with pytest.raises(KeyError):
        index.array("x.after")
