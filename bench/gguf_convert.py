"""HF checkpoint -> GGUF with llama.cpp's own converter, for bench/families_gguf.py.

The converter (``convert_hf_to_gguf.py``, its ``conversion`` package and ``gguf-py``) is
unpacked once from the llama.cpp vendored in the llama-cpp-python sdist on PyPI (the
version bench/llamacpp_build.py builds llama-server from) into
``~/.cache/tokenrelay-bench/llama.cpp/convert-<version>/`` and run in a subprocess with
this interpreter, the sdist's gguf-py first on the path and the converter's one missing
requirement (sentencepiece) installed beside it. The F16 file it writes is then
quantized with ``llama-quantize`` (``quantize`` in bench/model_1b.py).

The converter takes a SentencePiece ``tokenizer.model`` for some families (Gemma-2; Phi-3
unless ``tokenizer_config.json`` names ``GPT2Tokenizer``); the bench's checkpoints carry
the default model's BPE ``tokenizer.json``. For the architectures in ``BPE_VOCAB`` the
subprocess sets the converter's ``set_vocab`` to its own BPE path (``_set_vocab_gpt2``,
the path Phi-3 takes for ``GPT2Tokenizer`` and Gemma-3 takes without
``tokenizer.model``) before the converter runs; the weights and hyperparameters are
converted as they are. ``name`` is written as ``general.name``: llama.cpp's vocabulary
loader keys a Phi-3 tokenizer fix-up on that name (a name holding ``phi3`` or ``phi-3``
makes it look up ``</s>``, ``<unk>`` and ``<s>``, which a vocabulary without them fails
to load on), so a checkpoint with another family's tokenizer is given a neutral one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.llamacpp_build import CACHE

SDIST_VERSION = "0.3.36"
CONVERTER = CACHE / f"convert-{SDIST_VERSION}"
MEMBERS = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")
# what the converter imports that the project's environment lacks (its requirements' pin),
# installed beside it (``deps/``), not into the environment
DEPS = ("sentencepiece>=0.1.98,<0.3.0",)
# HF architectures whose converter only reads SentencePiece: given the converter's BPE path
BPE_VOCAB = ("Phi3ForCausalLM", "Gemma2ForCausalLM")

# run in the subprocess: argv = root, arch to patch ("" for none), then the converter's own
WRAPPER = """
import runpy, sys
root, patch = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
sys.path[:0] = [root, root + "/gguf-py"]
if patch:
    from conversion import get_model_class
    get_model_class(patch).set_vocab = lambda self: self._set_vocab_gpt2()
    print(f"bench: {patch}: the converter's BPE vocabulary path (_set_vocab_gpt2)", flush=True)
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def get_converter(say: Callable[..., None] = print) -> Path:
    """The unpacked converter folder, downloaded and unpacked the first time."""
    if (CONVERTER / "convert_hf_to_gguf.py").is_file():
        return CONVERTER
    work = Path(tempfile.mkdtemp(prefix="llamacpp-convert-"))
    try:
        say(f"getting llama.cpp's converter from llama-cpp-python=={SDIST_VERSION} (sdist)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"llama-cpp-python=={SDIST_VERSION}", "-d", str(work)],
                       check=True, timeout=1800)  # fmt: skip
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        tmp = CONVERTER.with_name(CONVERTER.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                rel = member.name.removeprefix(prefix)
                if rel == member.name or rel.split("/")[0] not in MEMBERS:
                    continue
                if not (member.isfile() or member.isdir()):
                    continue
                member.name = rel
                tar.extract(member, tmp, filter="data")
        if not (tmp / "convert_hf_to_gguf.py").is_file():
            raise SystemExit(f"{sdist.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target",
                        str(tmp / "deps"), *DEPS], check=True, timeout=1800)  # fmt: skip
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp.rename(CONVERTER)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"converter: {CONVERTER}")
    return CONVERTER


def architecture(checkpoint: Path) -> str:
    import json

    return str(json.loads((checkpoint / "config.json").read_text())["architectures"][0])


def convert(
    checkpoint: Path, out: Path, say: Callable[..., None] = print, name: str | None = None
) -> Path:
    """``checkpoint`` (an HF folder) -> the F16 GGUF ``out``, by llama.cpp's converter;
    ``name``: the file's ``general.name`` (the converter's, from the folder, if None)."""
    root = get_converter(say)
    arch = architecture(checkpoint)
    patch = arch if arch in BPE_VOCAB else ""
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = os.pathsep.join(
        x
        for x in (str(root / "gguf-py"), str(root), str(root / "deps"), env.get("PYTHONPATH"))
        if x
    )
    cmd = [sys.executable, "-c", WRAPPER, str(root), patch, str(checkpoint),
           "--outfile", str(tmp), "--outtype", "f16"]  # fmt: skip
    if name is not None:
        cmd += ["--model-name", name]
    say(f"converting {checkpoint.name} ({arch}) with {root / 'convert_hf_to_gguf.py'}")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"convert_hf_to_gguf.py failed on {checkpoint}:\n{text[-4000:]}")
    for line in text.splitlines():  # what the run has to say about the vocabulary
        if line.startswith("bench:") or "chkhsh" in line or "pre-tokenizer" in line.lower():
            say(f"  {line.strip()}")
    tmp.replace(out)
    return out
