"""The one table bench.gpu_check prints, from its JSON record (the ``out`` dict)."""

from __future__ import annotations

from typing import Any

TARGET_RATIO = 10.0  # ours / transformers, output tok/s on the throughput workload
TARGET_ROOFLINE = 0.5  # batch-1 decode with graphs, as a share of the roofline speed


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "**FAIL**")


def _status(rec: dict[str, Any]) -> str | None:
    """A cell for a phase that did not finish, else None."""
    if rec["status"] == "failed":
        error = " ".join(rec["error"].split()).replace("|", "/")  # one line, no cell break
        return f"ERROR: {error[:160]}"
    if rec["status"] != "ok":
        return f"{rec['status']}: {rec.get('reason', '')}"
    return None


def throughput_ratio(out: dict[str, Any]) -> float | None:
    """Ours / transformers output tok/s, when both throughput phases ran."""
    ours, hf = out["phases"]["throughput_ours"], out["phases"]["throughput_transformers"]
    if ours["status"] == hf["status"] == "ok" and hf["tok_s"] > 0:
        return float(ours["tok_s"] / hf["tok_s"])
    return None


def summary_rows(out: dict[str, Any], cuda: bool) -> list[tuple[str, str, str, str]]:
    """(check, result, target, verdict) rows of the one table."""
    ph = out["phases"]
    rows = []
    prefer = ("throughput_ours", "correctness_qwen3", "latency_graphs", "correctness_smollm2")
    eng = next((ph[p]["engine"] for p in prefer if "engine" in ph[p]), None)
    if eng:
        graphs = ",".join(map(str, eng["graph_buckets"])) or "none"
        rows.append(
            (
                "engine",
                f"backend {eng['attention_backend']}, {eng['dtype']}, block {eng['block_size']}, "
                f"graph buckets {graphs}, {eng['kv_blocks']} KV blocks",
                "",
                "",
            )
        )
    bw = ph["bandwidth"]
    rows.append(
        (
            "copy bandwidth",
            _status(bw) or f"{bw['gb_s']:.0f} GB/s ({bw['bytes'] / 2**30:g} GiB copy, read+write)",
            "",
            "",
        )
    )
    for key in ("correctness_smollm2", "correctness_qwen3"):
        rec = ph[key]
        res = _status(rec)
        if res is None:
            chunk, n = rec["max_num_batched_tokens"], len(rec["prompts"])
            res = (
                f"{rec['model']}: {n} prompts x {rec['prompts'][0]['tokens']} tokens: "
                f"{rec['equal']} equal, {rec['ties']} ties, {rec['mismatches']} mismatches"
                + (f" ({chunk}-token steps: chunked prefill)" if chunk else "")
            )
        ok = {"ok": rec.get("passed"), "failed": False}.get(rec["status"])
        rows.append((key, res, "tokens equal or first divergence a tie", _verdict(ok)))
    ours, hf = ph["throughput_ours"], ph["throughput_transformers"]
    res = " vs ".join(
        _status(r)
        or f"{r['name']} {r['tok_s']:.0f} tok/s ({r['output_tokens']} tokens, "
        f"{r['seconds']:.1f}s{', PARTIAL' if r['partial'] else ''})"
        for r in (ours, hf)
    )
    ratio = throughput_ratio(out)
    if ratio is not None:
        res += f": **{ratio:.2f}x**"
    ok = None if not cuda else (ratio is not None and ratio >= TARGET_RATIO)
    rows.append(("throughput", res, f">= {TARGET_RATIO:g}x transformers", _verdict(ok)))
    for key, label in (("latency_graphs", "CUDA graphs"), ("latency_eager", "eager")):
        rec = ph[key]
        res = _status(rec)
        if res is None:
            res = f"{rec['median_ms']:.2f} ms/token median ({rec['tok_s']:.0f} tok/s)"
            if rec["of_roofline"] is not None:
                res += f", {rec['of_roofline']:.0%} of the roofline {rec['roofline_ms']:.3f} ms"
        target, ok = "", None
        if key == "latency_graphs":
            target = f">= {TARGET_ROOFLINE:.0%} of roofline"
            if cuda:
                ok = rec["status"] == "ok" and (rec["of_roofline"] or 0) >= TARGET_ROOFLINE
        rows.append((f"batch-1 decode, {label}", res, target, _verdict(ok) if target else ""))
    tp = ph.get("tensor_parallel")
    if tp is not None:
        res = _status(tp)
        if res is None:
            res = (
                f"TP={tp['size']} of {tp['gpus']} GPUs: {len(tp['prompts'])} prompts: "
                f"{tp['equal']} equal, {tp['ties']} ties, {tp['mismatches']} mismatches; "
                f"{tp['same_as_tp1']} the same as TP=1; batch-1 decode {tp['median_ms']:.2f} ms"
            )
        ok = {"ok": tp.get("passed"), "failed": False}.get(tp["status"])
        rows.append(("tensor parallel", res, "tokens equal or first divergence a tie",
                     _verdict(ok)))  # fmt: skip
    return rows


def print_report(
    out: dict[str, Any], rows: list[tuple[str, str, str, str]], total_s: float
) -> None:
    """The summary table (``rows``), then the per-prompt first divergences, on stdout."""
    m, a = out["machine"], out["args"]
    dev = f"{m['gpu']} ({m['gpu_mem_gib']} GiB)" if "gpu" in m else "CPU only"
    print(f"\n## gpu_check{' --tiny' if a['tiny'] else ''}: {dev}")
    print(
        f"\ntorch {m['torch']} (CUDA {m['cuda']}), transformers {m['transformers']}, "
        f"triton {m['triton']}, flash-attn {m['flash_attn'] or 'no'}; host {m['cpu']}; "
        f"throughput: {a['num_requests']} requests, lengths {a['min_len']}..{a['max_len']}\n"
    )
    print("| check | result | target | verdict |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    diverged = [
        (out["phases"][k]["model"], r)
        for k in ("correctness_smollm2", "correctness_qwen3")
        if out["phases"][k]["status"] == "ok"
        for r in out["phases"][k]["prompts"]
        if r["verdict"] != "equal"
    ]
    if diverged:
        print("\nfirst divergences (transformers' logits at that step; gap = its top-1 - ours):\n")
        print(
            "| model | prompt len | agree | at | ours/ref | gap | ulps | top-2 gap | our rank "
            "| verdict |"
        )
        print("|---|---:|---:|---:|---|---:|---:|---:|---:|---|")
        for model, r in diverged:
            if "gap" not in r:  # a length difference, no token to judge
                cells = f"| {model} | {r['prompt_len']} | {r['agree']:.0%} |"
                print(cells + " - | - | - | - | - | - | length |")
                continue
            print(
                f"| {model} | {r['prompt_len']} | {r['agree']:.0%} | {r['first_divergence']} | "
                f"{r['ours_token']}/{r['ref_token']} | {r['gap']:.4f} | {r['gap_ulps']:.1f} | "
                f"{r['top2_gap']:.4f} | {r['ours_rank']} | {r['verdict']} |"
            )
    phases = ", ".join(f"{k} {v['seconds']}s" for k, v in out["phases"].items() if "seconds" in v)
    print(f"\nphases: {phases}; total {total_s:.1f}s")
