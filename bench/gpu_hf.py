"""transformers' continuous batching on the throughput workload, for bench.gpu_check.

Drives the manager behind ``generate_batch`` directly so each request gets its own
``max_new_tokens`` (nano-vllm's workload has one output length per request), with
EOS disabled. It has changed across transformers versions: every keyword is passed
only where the installed version takes it, and what could not be honoured goes in
the result's note.
"""

from __future__ import annotations

import copy
import inspect
import time
from typing import Any

from bench.gpu_models import PAD_ID, Result


def _supported(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``kwargs`` that ``fn`` names as parameters."""
    params = inspect.signature(fn).parameters
    named = {k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    # **kwargs of add_request are logits-processor kwargs: pass only named ones
    return {k: v for k, v in kwargs.items() if k in named}


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


def _init_kwargs(
    hf: Any, prompts: list[list[int]], out_lens: list[int], notes: list[str]
) -> dict[str, Any]:
    gen = copy.deepcopy(hf.generation_config)
    gen.do_sample = False
    gen.max_new_tokens = max(out_lens)
    gen.min_new_tokens = None
    gen.eos_token_id = []  # never stop on EOS (ignore_eos)
    gen.pad_token_id = PAD_ID
    kwargs: dict[str, Any] = {"generation_config": gen}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        # flash-attn is absent; never let transformers try to fetch a kernel from the Hub
        cb: dict[str, Any] = {"auto_switch_to_flash": False}
        if hf.device.type == "cpu":  # it would size its cache from host RAM (GiBs): keep it small
            # (a fixed size: transformers 5.25 infers a negative one from a small RAM share)
            cb["num_blocks"], cb["max_batch_tokens"] = 512, 512
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**cb)
    except (ImportError, TypeError):
        notes.append("default ContinuousBatchingConfig")
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints

        kwargs["workload_hints"] = WorkloadHints(
            max_prompt_length=max(map(len, prompts)),
            max_generated_length=max(out_lens),
            num_requests=len(prompts),
        )
    except (ImportError, TypeError):
        pass
    return _supported(hf.init_continuous_batching, kwargs)


def _warm(manager: Any, warm: list[list[int]]) -> None:
    for i, p in enumerate(warm):
        _add(manager, f"warm-{i}", p, 8)
    waiting = len(warm)
    while waiting:
        r = manager.get_result(timeout=1)
        if r is not None and _finished(r):
            waiting -= 1
        elif r is None and not manager.is_running():
            raise RuntimeError("transformers CB manager died during warm-up")


def run_hf_cb(
    hf: Any, prompts: list[list[int]], out_lens: list[int], deadline: float, warm: list[list[int]]
) -> Result:
    """Output tokens / wall time of transformers CB; cut at ``deadline`` (perf_counter)."""
    import torch

    notes: list[str] = []
    init_kwargs = _init_kwargs(hf, prompts, out_lens, notes)
    started = time.perf_counter()
    partial = False
    results: dict[str, Any] = {}
    with torch.inference_mode():
        manager = hf.init_continuous_batching(**init_kwargs)
        if "max_new_tokens" not in inspect.signature(manager.add_request).parameters:
            notes.append("no per-request max_new_tokens: every request ran to the max")
        if hasattr(manager, "warmup") and not getattr(manager, "warmed_up", False):
            try:  # what generate_batch(warmup=True) does (CUDA graph capture)
                manager.warmup()
            except Exception as exc:  # an older signature: the warm-up requests still warm up
                notes.append(f"manager.warmup() failed: {exc!r}")
        manager.start()
        try:
            _warm(manager, warm)
            warmup_s = time.perf_counter() - started
            start = time.perf_counter()
            for i, (p, o) in enumerate(zip(prompts, out_lens, strict=True)):
                _add(manager, f"tp-{i}", p, o)
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
            results.setdefault(r.request_id, r)
        notes.append("tokens of unfinished requests counted where transformers returned them")
    if hasattr(manager, "destroy"):
        manager.destroy()
    del manager
    ok = [r for r in results.values() if getattr(r, "error", None) is None and _finished(r)]
    produced = sum(len(getattr(r, "generated_tokens", [])) for r in results.values())
    if len(results) > len(ok) and not partial:
        notes.append(f"{len(results) - len(ok)} failed requests")
    if not partial and produced != sum(out_lens):
        notes.append(f"produced {produced} != requested {sum(out_lens)}")
    notes.insert(0, f"continuous batching, attn {getattr(hf.config, '_attn_implementation', '?')}")
    prompt_tokens = sum(len(getattr(r, "prompt_ids", [])) for r in results.values())
    return Result(
        "transformers CB",
        seconds,
        produced,
        prompt_tokens,
        len(ok),
        len(prompts),
        partial,
        warmup_s,
        "; ".join(notes),
    )
