"""Our engine's side of bench.gpu_check: greedy tokens, step times, throughput, bandwidth."""

from __future__ import annotations

import gc
import time
from typing import Any

from bench.gpu_models import Result


def free(device: Any) -> None:
    """Return freed tensors' memory (an engine sizes its KV pool from free memory)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def copy_bandwidth(device: Any, nbytes: int) -> dict[str, Any]:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``nbytes`` on ``device``."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    iters = 50 if device.type == "cuda" else 3
    for _ in range(2):
        dst.copy_(src)
    free(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return {"bytes": nbytes, "iters": iters, "gb_s": 2 * nbytes * iters / seconds / 1e9}


def runner_info(llm: Any) -> dict[str, Any]:
    """What the engine resolved: backend, dtype, block size, CUDA graph buckets."""
    runner = llm.engine.runner
    return {
        "attention_backend": str(getattr(runner, "attention_backend", "?")),
        "dtype": str(getattr(runner, "dtype", "?")).replace("torch.", ""),
        "block_size": getattr(runner, "block_size", None),
        "graph_buckets": list(getattr(runner, "graph_buckets", ())),
        "kv_blocks": getattr(runner, "num_blocks", None),
    }


def our_greedy(llm: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from tokenrelay.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(prompts, params)]


def step_times(engine: Any, rid: str, prompt: list[int], tokens: int) -> list[float]:
    """Run one request alone; the wall time of every step that gave it a token."""
    from tokenrelay.engine import SamplingParams

    engine.add_request(
        rid, prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    )
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - start
        if any(o.request_id == rid and o.new_token_ids for o in outs):
            times.append(took)
    return times


def run_ours(
    engine: Any,
    prompts: list[list[int]],
    out_lens: list[int],
    deadline: float,
    warm: list[list[int]],
) -> Result:
    """The throughput workload through our engine, all requests at once."""
    from tokenrelay.engine import SamplingParams

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
    note = (
        f"{after['num_steps'] - before['num_steps']} steps, "
        f"{after['preemptions'] - before['preemptions']} preemptions"
    )
    if not partial and produced != sum(out_lens):
        note += f"; produced {produced} != requested {sum(out_lens)}"
    prompt_done = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    return Result(
        "tokenrelay", seconds, produced, prompt_done, done, len(prompts), partial, warmup_s, note
    )
