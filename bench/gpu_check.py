"""One-shot GPU check of our engine against transformers on a Qwen3-0.6B-shaped model.

Needs no download: it builds a Qwen3-0.6B-shaped model with random weights
(seeded, bf16 safetensors) and a synthetic word-level tokenizer covering every
id ("t0" .. "t151935") in a temporary folder, then

1. bf16 correctness: our decoder over the paged KV cache (prefill, chunked
   prefill and single-token decode steps) against transformers'
   ``Qwen3ForCausalLM`` on the same device: max abs diff, relative error and
   top-1 agreement of the logits per prompt; then 32 greedy tokens from our
   ``LLMEngine`` against transformers ``generate`` (bf16 drift is reported,
   not asserted);
2. throughput as nano-vllm publishes it: 256 requests, input and output lengths
   uniform in [100, 1024] (seeded), random token ids, greedy, EOS ignored, all
   submitted at once; output tokens / wall time of our ``LLMEngine`` against
   transformers' continuous batching (the manager behind ``generate_batch``,
   driven directly so each request gets its own ``max_new_tokens``). Each
   system has a time guard; a run cut short is reported as PARTIAL.

Runs from a bare checkout (``python -m`` in the repo root puts it on ``sys.path``; no pip install)
with only torch, transformers, tokenizers and safetensors (our engine also
imports numpy and filelock, which transformers and huggingface_hub require;
flash-attn is used when present, never needed). ``--budget`` (330 s) bounds the
whole run: our engine gets about 45% of what is left after the correctness
checks, transformers the rest. Markdown tables on stdout (progress on stderr);
``--json`` is rewritten after every phase, so a killed run still leaves data.

    python3 -m bench.gpu_check --json $OUT/gpu_check.json                  # the GPU run
    .venv/bin/python -m bench.gpu_check --tiny --device cpu --json /tmp/g.json  # smoke test
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import inspect
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import machine

T0 = time.monotonic()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads

# Qwen3-0.6B's shapes; ``--tiny`` swaps in a model that runs anywhere in seconds.
FULL_SHAPE: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=40960,
)
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=4096,
)
ROPE_THETA = 1_000_000.0
EOS_ID, PAD_ID = 1, 0  # "t1" and "t0" in the synthetic tokenizer
# Prompt lengths and how each is fed through the paged cache (chunks; 1 = a decode step).
LOGIT_CASES: list[tuple[int, list[int]]] = [
    (16, [16]),
    (100, [100]),
    (257, [128, 121] + [1] * 8),
    (512, [512]),
]
GREEDY_LENS = (16, 64, 200, 500)
GREEDY_TOKENS = 32


@dataclass
class Result:
    name: str
    seconds: float
    output_tokens: int
    prompt_tokens: int
    requests_done: int
    requests: int
    partial: bool = False
    warmup_s: float = 0.0
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Report:
    args: dict[str, Any]
    machine: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    logits: list[dict[str, Any]] = field(default_factory=list)
    greedy: list[dict[str, Any]] = field(default_factory=list)
    throughput: list[dict[str, Any]] = field(default_factory=list)
    workload: dict[str, Any] = field(default_factory=dict)
    ratio: float | None = None
    ratio_note: str = ""
    errors: list[str] = field(default_factory=list)
    complete: bool = False  # False: the run stopped early (or is still going)


def elapsed() -> float:
    return time.monotonic() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)


def machine_info(device: Any) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cpu": machine(),
        "device": str(device),
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
        info["cudnn"] = torch.backends.cudnn.version()
    return info


# ------------------------------------------------------------------ model + tokenizer
def build_checkpoint(
    folder: Path, shape: dict[str, Any], seed: int, device: Any, dtype: Any
) -> Any:
    """Random Qwen3 weights (saved as ``dtype`` safetensors) + a word-level tokenizer.

    Returns the transformers model (on ``device``, in ``dtype``, eval mode): the
    reference, holding exactly the saved weights.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    kwargs: dict[str, Any] = dict(
        shape,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        # logits = normed hidden @ embed^T: std ~ init_std * sqrt(hidden) = 0.64 (0.02 at 1024)
        initializer_range=0.64 / shape["hidden_size"] ** 0.5,
        use_sliding_window=False,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        bos_token_id=None,
    )
    if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    else:
        kwargs["rope_theta"] = ROPE_THETA
    config = Qwen3Config(**kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = None
    model.save_pretrained(str(folder))

    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=f"t{EOS_ID}", pad_token=f"t{PAD_ID}", unk_token="t0"
    )
    fast.save_pretrained(str(folder))
    return model


def check_loadable(folder: Path, shape: dict[str, Any]) -> None:
    """Our config parser and model store accept the folder, with the intended shapes."""
    from engine.models.config import ModelConfig
    from engine.models.store import resolve_model

    resolve_model(str(folder))
    cfg = ModelConfig.from_pretrained(folder)
    got = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    want = (
        shape["num_hidden_layers"],
        shape["hidden_size"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
    )
    problems = []
    if got != want:
        problems.append(f"shapes {got} != {want}")
    if cfg.rope.theta != ROPE_THETA or cfg.rope.rope_type != "default":
        problems.append(f"rope {cfg.rope.rope_type} theta {cfg.rope.theta}")
    if not (cfg.qk_norm and cfg.tie_word_embeddings and not cfg.qkv_bias):
        problems.append("qwen3 flags (qk_norm, tied, no bias)")
    if problems:
        raise RuntimeError(f"model config read back wrong: {'; '.join(problems)}")


# ------------------------------------------------------------------ correctness
def our_logits(
    model: Any, cache: Any, ids: list[int], chunks: list[int], table: list[int], dtype: Any
) -> Any:
    """Feed ``ids`` through our paged cache in ``chunks``; fp32 logits of every position."""
    import torch

    from engine.runner.attention import build_metadata

    device = cache.data.device
    out, pos = [], 0
    with torch.inference_mode():
        for n in chunks:
            meta = build_metadata(
                [n], [pos], [table], block_size=cache.block_size, device=device, dtype=dtype
            )
            x = torch.tensor(ids[pos : pos + n], dtype=torch.int64, device=device)
            out.append(model.compute_logits(model(x, meta.positions, meta, cache)))
            pos += n
    return torch.cat(out)


def check_logits(folder: Path, hf: Any, device: Any, dtype: Any, seed: int) -> list[dict[str, Any]]:
    import torch

    from engine.models.config import ModelConfig
    from engine.models.weights import load_model
    from engine.runner.kv_cache import KVCache

    cfg = ModelConfig.from_pretrained(folder)
    model = load_model(folder, cfg, device, dtype)
    block = 16
    num_blocks = max(n for n, _ in LOGIT_CASES) // block + 8
    rows = []
    try:
        for i, (n, chunks) in enumerate(LOGIT_CASES):
            rng = random.Random(seed * 1000 + i)
            ids = [rng.randrange(cfg.vocab_size) for _ in range(n)]
            blocks = list(range(num_blocks))
            rng.shuffle(blocks)  # non-contiguous block table
            # a fresh cache per prompt: nothing leaks between cases
            cache = KVCache(cfg, num_blocks, block, dtype, device)
            ours = our_logits(model, cache, ids, chunks, blocks[: -(-n // block)], dtype)
            with torch.inference_mode():
                ref = hf(torch.tensor([ids], device=device)).logits[0].float()
            diff = ours - ref
            rows.append(
                {
                    "prompt_len": n,
                    "chunks": _chunks_str(chunks),
                    "max_abs_diff": diff.abs().max().item(),
                    "rel_err": (diff.norm() / ref.norm()).item(),
                    "top1_agree": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                    "ref_logit_std": ref.std().item(),
                }
            )
            del cache, ours, ref, diff
    finally:
        del model
        _free(device)
    return rows


def _chunks_str(chunks: list[int]) -> str:
    ones = 0
    while ones < len(chunks) and chunks[-1 - ones] == 1:
        ones += 1
    head = "+".join(str(c) for c in chunks[: len(chunks) - ones])
    return head + (f" +{ones}x1 decode" if ones else "")


def hf_greedy(hf: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch

    config = copy.deepcopy(hf.generation_config)
    config.do_sample = False
    config.max_new_tokens = new_tokens
    config.min_new_tokens = None
    config.eos_token_id = []  # generate through EOS, like our ignore_eos
    config.pad_token_id = PAD_ID
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=hf.device)
            gen = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            out.append(gen[0, len(ids) :].tolist())
    return out


def our_greedy(engine: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    got: dict[str, list[int]] = {f"greedy-{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(f"greedy-{i}", p, params)
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return [got[f"greedy-{i}"] for i in range(len(prompts))]


def compare_greedy(ours: list[list[int]], ref: list[list[int]]) -> list[dict[str, Any]]:
    rows = []
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        same = sum(x == y for x, y in zip(a, b, strict=False))
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        rows.append(
            {
                "prompt_len": GREEDY_LENS[i],
                "tokens": len(b),
                "agree": same / max(len(b), 1),
                "first_divergence": first,
                "ours_head": a[:8],
                "ref_head": b[:8],
            }
        )
    return rows


# ------------------------------------------------------------------ throughput
def make_workload(
    n: int, lo: int, hi: int, vocab: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench: random ids, input and output lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    prompts, out_lens = [], []
    for _ in range(n):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))])
        out_lens.append(rng.randint(lo, hi))
    return prompts, out_lens


def run_ours(
    engine: Any,
    prompts: list[list[int]],
    out_lens: list[int],
    deadline: float,
    warm: list[list[int]],
) -> Result:
    from engine import SamplingParams

    started = time.perf_counter()
    wp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, p in enumerate(warm):
        engine.add_request(f"warm-{i}", p, wp)
    while engine.has_unfinished():
        engine.step()
    engine.reset_prefix_cache()
    warmup_s = time.perf_counter() - started

    before = engine.stats()
    start = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, out_lens, strict=True)):
        engine.add_request(
            f"tp-{i}", p, SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)
        )
    produced = done = 0
    partial = False
    while engine.has_unfinished():
        if time.perf_counter() > deadline:
            partial = True
            break
        for out in engine.step():
            produced += len(out.new_token_ids)
            done += out.finished
    seconds = time.perf_counter() - start
    if partial:
        for i in range(len(prompts)):
            engine.abort(f"tp-{i}")
        while engine.has_unfinished():
            engine.step()
    after = engine.stats()
    steps = after["num_steps"] - before["num_steps"]
    prompt_done = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    note = f"{steps} steps, {after['preemptions'] - before['preemptions']} preemptions"
    if not partial and produced != sum(out_lens):
        note += f"; produced {produced} != requested {sum(out_lens)}"
    return Result(
        "tokenrelay LLMEngine",
        seconds,
        produced,
        prompt_done,
        done,
        len(prompts),
        partial,
        warmup_s,
        note,
    )


def _supported(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        named = {k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        # **kwargs of add_request are logits-processor kwargs: pass only named ones
        return {k: v for k, v in kwargs.items() if k in named}
    return {k: v for k, v in kwargs.items() if k in params}


def _finished(result: Any) -> bool:
    """A CB result in a terminal state (finished or failed), across transformers versions."""
    fn = getattr(result, "is_finished", None)
    if callable(fn):
        return bool(fn())
    status = getattr(result, "status", None)
    return getattr(status, "name", str(status)).upper() in ("FINISHED", "FAILED")


def _add(manager: Any, rid: str, ids: list[int], max_new_tokens: int) -> None:
    """One request to the CB manager, EOS disabled, with its own ``max_new_tokens``."""
    kw = _supported(
        manager.add_request,
        {"request_id": rid, "max_new_tokens": max_new_tokens, "eos_token_id": -1},
    )
    manager.add_request(ids, **kw)


def run_hf_cb(
    hf: Any, prompts: list[list[int]], out_lens: list[int], deadline: float, warm: list[list[int]]
) -> Result:
    """transformers continuous batching (``generate_batch``'s manager), per-request lengths."""
    import torch

    notes = []
    gen = copy.deepcopy(hf.generation_config)
    gen.do_sample = False
    gen.max_new_tokens = max(out_lens)
    gen.min_new_tokens = None
    gen.eos_token_id = []  # never stop on EOS (ignore_eos)
    gen.pad_token_id = PAD_ID
    init_kwargs: dict[str, Any] = {"generation_config": gen}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        # flash-attn is absent; never let transformers try to fetch a kernel from the Hub
        cb: dict[str, Any] = {"auto_switch_to_flash": False}
        if hf.device.type == "cpu":  # it would size its cache from host RAM (GiBs): keep it small
            cb["max_memory_percent"] = 0.02
        init_kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb)
    except (ImportError, TypeError):
        notes.append("default ContinuousBatchingConfig")
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        init_kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(map(len, prompts)),
            max_generated_length=max(out_lens),
            num_requests=len(prompts),
        )
    except (ImportError, TypeError):
        pass
    init_kwargs = _supported(hf.init_continuous_batching, init_kwargs)
    started = time.perf_counter()
    partial = False
    with torch.inference_mode():
        manager = hf.init_continuous_batching(**init_kwargs)
        per_request = "max_new_tokens" in inspect.signature(manager.add_request).parameters
        if not per_request:
            notes.append("no per-request max_new_tokens: every request ran to the max")
        if hasattr(manager, "warmup") and not getattr(manager, "warmed_up", False):
            try:  # what generate_batch(warmup=True) does (CUDA graph capture)
                manager.warmup()
            except Exception as exc:  # an older signature: the warm-up requests still warm up
                notes.append(f"manager.warmup() failed: {exc!r}")
        manager.start()
        try:
            for i, p in enumerate(warm):
                _add(manager, f"warm-{i}", p, 8)
            waiting = len(warm)
            while waiting:
                r = manager.get_result(timeout=1)
                if r is not None and _finished(r):
                    waiting -= 1
                elif r is None and not manager.is_running():
                    raise RuntimeError("transformers CB manager died during warm-up")
            warmup_s = time.perf_counter() - started

            start = time.perf_counter()
            for i, (p, o) in enumerate(zip(prompts, out_lens, strict=True)):
                _add(manager, f"tp-{i}", p, o)
            results: dict[str, Any] = {}
            while len(results) < len(prompts):
                if time.perf_counter() > deadline:
                    partial = True
                    break
                r = manager.get_result(timeout=0.5)
                if r is None:
                    if not manager.is_running():
                        notes.append("manager thread died")
                        partial = True
                        break
                    continue
                if _finished(r):
                    results[r.request_id] = r
            seconds = time.perf_counter() - start
        finally:
            stop_kw = _supported(manager.stop, {"block": True, "timeout": 30, "hard_stop": True})
            if not partial:
                stop_kw.pop("hard_stop", None)
            elif "hard_stop" not in stop_kw and hasattr(manager, "cancel_request"):
                for i in range(len(prompts)):  # no hard stop in this version: cancel what is left
                    if f"tp-{i}" not in results:
                        manager.cancel_request(f"tp-{i}")
            manager.stop(**stop_kw)
    if partial:  # requests cut off by the hard stop come back failed, with their tokens so far
        while (r := manager.get_result(timeout=0.2)) is not None:
            if r.request_id not in results:
                results[r.request_id] = r
        notes.append("tokens of unfinished requests counted where transformers returned them")
    if hasattr(manager, "destroy"):
        manager.destroy()
    del manager
    ok = [r for r in results.values() if getattr(r, "error", None) is None and _finished(r)]
    produced = sum(len(getattr(r, "generated_tokens", [])) for r in results.values())
    failed = len(results) - len(ok)
    if failed and not partial:
        notes.append(f"{failed} failed requests")
    want = sum(out_lens)
    if not partial and produced != want:
        notes.append(f"produced {produced} != requested {want}")
    attn = getattr(hf.config, "_attn_implementation", "?")
    notes.insert(0, f"continuous batching, attn {attn}")
    prompt_tokens = sum(len(getattr(r, "prompt_ids", [])) for r in results.values())
    return Result(
        "transformers CB (generate_batch manager)",
        seconds,
        produced,
        prompt_tokens,
        len(ok),
        len(prompts),
        partial,
        warmup_s,
        "; ".join(notes),
    )


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ output
def print_tables(rep: Report, results: list[Result]) -> None:
    m = rep.machine
    print(f"\n## gpu_check ({'tiny' if rep.args['tiny'] else 'Qwen3-0.6B-shaped'}, random weights)")
    dev = f"{m['gpu']} ({m['gpu_mem_gib']} GiB)" if "gpu" in m else "CPU only"
    print(
        f"\nmachine: {dev}; torch {m['torch']} "
        f"(CUDA {m['cuda']}), transformers {m['transformers']}, flash-attn "
        f"{'yes' if m['flash_attn'] else 'no'}; host {m['cpu']}"
    )
    if rep.logits:
        print(f"\n### bf16 logits: ours (paged cache) vs transformers ({rep.args['dtype']})\n")
        print("| prompt len | chunks | max abs diff | rel err | top-1 agree | ref logit std |")
        print("|---:|---|---:|---:|---:|---:|")
        for r in rep.logits:
            print(
                f"| {r['prompt_len']} | {r['chunks']} | {r['max_abs_diff']:.4f} | "
                f"{r['rel_err']:.2e} | {r['top1_agree'] * 100:.1f}% | {r['ref_logit_std']:.3f} |"
            )
    if rep.greedy:
        print(f"\n### greedy {GREEDY_TOKENS} tokens: our LLMEngine vs transformers generate\n")
        print("| prompt len | tokens | agree | first divergence |")
        print("|---:|---:|---:|---:|")
        for r in rep.greedy:
            first = "-" if r["first_divergence"] is None else str(r["first_divergence"])
            print(f"| {r['prompt_len']} | {r['tokens']} | {r['agree'] * 100:.1f}% | {first} |")
    if results:
        a = rep.args
        print(
            f"\n### throughput: {a['num_requests']} requests, input/output lengths uniform in "
            f"[{a['min_len']}, {a['max_len']}], greedy, ignore_eos\n"
        )
        print(
            "| system | time (s) | output tok/s | total tok/s | requests done | output tokens "
            "| warm-up (s) | notes |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for res in results:
            name = res.name + (" **PARTIAL (time guard)**" if res.partial else "")
            print(
                f"| {name} | {res.seconds:.1f} | {res.tok_s:.1f} | {res.total_tok_s:.1f} | "
                f"{res.requests_done}/{res.requests} | {res.output_tokens} | "
                f"{res.warmup_s:.1f} | {res.note} |"
            )
        if rep.ratio is not None:
            print(f"\nours / transformers (output tok/s): **{rep.ratio:.2f}x**{rep.ratio_note}")
    if rep.errors:
        print("\n### errors\n")
        for e in rep.errors:
            print(f"- {e.splitlines()[-1] if e else e}")
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in rep.phases.items() if k != "total")
    print(f"\nphases: {phases}; total {elapsed():.1f}s")
    print(f"command: {' '.join(['python -m bench.gpu_check', *sys.argv[1:]])}")


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--tiny", action="store_true", help="tiny model, 16 requests of 8-32 tokens")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype for both systems")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--num-requests", type=int, default=None, help="256 (16 with --tiny)")
    ap.add_argument("--min-len", type=int, default=None, help="100 (8 with --tiny)")
    ap.add_argument("--max-len", type=int, default=None, help="1024 (32 with --tiny)")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="our engine's batch limit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf-throughput", action="store_true")
    args = ap.parse_args(argv)
    args.num_requests = args.num_requests or (16 if args.tiny else 256)
    args.min_len = args.min_len or (8 if args.tiny else 100)
    args.max_len = args.max_len or (32 if args.tiny else 1024)
    shape = TINY_SHAPE if args.tiny else FULL_SHAPE
    end = T0 + args.budget
    rep = Report(args=vars(args))
    results: list[Result] = []

    def phase(name: str, since: float) -> float:
        rep.phases[name] = time.monotonic() - since
        rep.throughput = _rows(results)
        save_json(rep, args.json)  # a run killed later still leaves what it measured
        return time.monotonic()

    from engine.runner.model_runner import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    rep.args["dtype"] = str(dtype).replace("torch.", "")
    rep.machine = machine_info(device)
    log(f"machine: {rep.machine}")
    t = time.monotonic()
    rep.phases["imports"] = elapsed()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        folder = Path(tmp)
        try:
            hf = build_checkpoint(folder, shape, args.seed, device, dtype)
            check_loadable(folder, shape)
            t = phase("build_model", t)
            log(f"checkpoint in {folder}: {sorted(p.name for p in folder.iterdir())}")

            rep.logits = check_logits(folder, hf, device, dtype, args.seed)
            t = phase("logits", t)
            log("logits compared")

            rng = random.Random(args.seed + 7)
            vocab = shape["vocab_size"]
            greedy_prompts = [[rng.randrange(vocab) for _ in range(n)] for n in GREEDY_LENS]
            ref_greedy = hf_greedy(hf, greedy_prompts, GREEDY_TOKENS)
            t = phase("hf_greedy", t)
        except Exception:
            rep.errors.append(traceback.format_exc())
            log(rep.errors[-1])
            finish(rep, results, args)
            return 1

        prompts, out_lens = make_workload(
            args.num_requests, args.min_len, args.max_len, vocab, args.seed + 1
        )
        warm = [[rng.randrange(vocab) for _ in range(args.max_len)] for _ in range(4)]
        rep.workload = {
            "prompt_tokens": sum(map(len, prompts)),
            "requested_output_tokens": sum(out_lens),
            "max_prompt": max(map(len, prompts)),
            "max_output": max(out_lens),
        }
        from engine import EngineConfig, LLMEngine

        _free(device)  # the pool is sized from free memory: return cached blocks first

        engine: Any = None
        try:
            engine = LLMEngine(
                EngineConfig(
                    model=str(folder),
                    device=args.device,
                    dtype=rep.args["dtype"],
                    max_num_seqs=args.max_num_seqs,
                    kv_cache_memory=0.25 if device.type == "cpu" else None,
                )
            )
            decoded = engine.tokenizer.decode([vocab - 2, vocab - 1, 5])
            if decoded.split() != [f"t{vocab - 2}", f"t{vocab - 1}", "t5"]:
                raise RuntimeError(f"tokenizer decodes {decoded!r}")
            rep.greedy = compare_greedy(
                our_greedy(engine, greedy_prompts, GREEDY_TOKENS), ref_greedy
            )
            t = phase("engine_load_greedy", t)
            log("greedy compared; our throughput run")
            # ours gets about half of what is left; transformers all the rest
            now = time.monotonic()
            deadline = time.perf_counter() + max(10.0, 0.45 * (end - now - 15))
            results.append(run_ours(engine, prompts, out_lens, deadline, warm))
            rep.machine["our_kv_blocks"] = engine.runner.num_blocks
            rep.machine["our_attention"] = "flash-attn" if engine.runner.use_flash else "torch"
            t = phase("ours_throughput", t)
            log(f"ours: {results[-1].seconds:.1f}s, {results[-1].tok_s:.1f} tok/s")
        except Exception:
            rep.errors.append(traceback.format_exc())
            log(rep.errors[-1])
        del engine
        _free(device)

        if not args.skip_hf_throughput:
            try:
                deadline = time.perf_counter() + max(10.0, end - time.monotonic() - 10)
                results.append(run_hf_cb(hf, prompts, out_lens, deadline, warm))
                t = phase("hf_throughput", t)
                log(f"transformers: {results[-1].seconds:.1f}s, {results[-1].tok_s:.1f} tok/s")
            except Exception:
                rep.errors.append(traceback.format_exc())
                log(rep.errors[-1])
        del hf
        _free(device)
    finish(rep, results, args)
    return 0 if not rep.errors else 1


def finish(rep: Report, results: list[Result], args: argparse.Namespace) -> None:
    names = [r.name for r in results]
    if len(results) == 2 and results[1].tok_s > 0:
        rep.ratio = results[0].tok_s / results[1].tok_s
        if any(r.partial for r in results):
            cut = ", ".join(r.name for r in results if r.partial)
            rep.ratio_note = f" (PARTIAL: {cut} stopped by the time guard)"
    rep.throughput = _rows(results)
    rep.phases["total"] = elapsed()
    print_tables(rep, results)
    rep.complete = True
    if args.json:
        save_json(rep, args.json)
        print(f"json: {args.json} ({', '.join(names) or 'no throughput'})")


def _rows(results: list[Result]) -> list[dict[str, Any]]:
    return [{**asdict(r), "tok_s": r.tok_s, "total_tok_s": r.total_tok_s} for r in results]


def save_json(rep: Report, path: str | None) -> None:
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(rep), indent=2, default=str) + "\n")


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()[1:]):
        os._exit(rc)  # a transformers generation thread that ignored stop must not hang us
    raise SystemExit(rc)
