"""The report of bench/vs_llamacpp.py: what ran where and how, the levels' and the memory
table, the long prompts' table, and the issues' targets (tokenrelay's figures over
llama.cpp's of the same run), each met or not."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import load_average
from bench.llamacpp_build import llama_version
from bench.stream_levels import Run
from bench.vs_llamacpp_servers import OURS, PEER, gib

SECTION = "## tokenrelay vs llama.cpp (CPU)"
ITL_TARGET = 1.25  # single-stream ITL p50: ours at most this times llama.cpp's
TPUT_TARGET = 1.5  # throughput at 16 and 64 (8 and 16 with --model): at least this times
ITL_TARGET_FILE = 1.1  # with --model (the 1B test file): single-stream ITL p50
RSS_TARGET = 1.3  # with --model: peak RSS over all processes at most this times llama.cpp's
LONG_TTFT_TARGET = 0.8  # --long-prompts: TTFT at most this times llama.cpp's...
LONG_TARGET_FROM = 4000  # ...from prompts of this many tokens (shorter ones: shown only)


def report_table(results: dict[str, Run]) -> str:
    lines = [
        "| streams | server | requests | tokens/request | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
        "| output tok/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    ours = results[OURS].levels if OURS in results else {}
    peer = results[PEER].levels if PEER in results else {}
    for c in sorted(set(ours) | set(peer)):
        sums = {}
        for name, res in ((OURS, ours), (PEER, peer)):
            if c not in res:
                continue
            s = sums[name] = res[c].summary()
            toks = f"{s['min_tokens']:.0f}" if s["min_tokens"] == s["max_tokens"] else (
                f"{s['min_tokens']:.0f}-{s['max_tokens']:.0f}")  # fmt: skip
            lines.append(
                f"| {c} | {name} | {s['requests']:.0f} | {toks} | {s['ttft_p50']:.1f} / "
                f"{s['ttft_p99']:.1f} | {s['itl_p50']:.1f} / {s['itl_p99']:.1f} "
                f"| {s['tok_s']:.1f} |"
            )
        if len(sums) == 2:
            a, b = sums[OURS], sums[PEER]
            lines.append(
                f"| {c} | {OURS} / {PEER} | | | {a['ttft_p50'] / b['ttft_p50']:.2f}x / "
                f"{a['ttft_p99'] / b['ttft_p99']:.2f}x | {ratio(a['itl_p50'], b['itl_p50'])} / "
                f"{ratio(a['itl_p99'], b['itl_p99'])} | {a['tok_s'] / b['tok_s']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def memory_table(results: dict[str, Run]) -> str:
    lines = [
        "| server | processes | peak RSS loading | RSS after warm-up | peak RSS (levels) "
        "| sizing |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name in (OURS, PEER):
        run = results.get(name)
        if run is None or run.memory is None:
            continue
        m = run.memory
        lines.append(
            f"| {name} | {m.processes} ({m.names}) | {gib(m.load_peak)} | {gib(m.after_warmup)} "
            f"| {gib(m.peak)} "
            f"| {run.config} |"
        )
    return "\n".join(lines) + "\n"


def long_table(results: dict[str, Run]) -> str:
    lines = [
        "| prompt (target tokens) | prompt tokens (usage) | tokenrelay TTFT (ms) "
        "| llama.cpp TTFT (ms) | tokenrelay / llama.cpp |",
        "|---:|---:|---:|---:|---:|",
    ]
    ours = results[OURS].long if OURS in results else {}
    peer = results[PEER].long if PEER in results else {}
    for n in sorted(set(ours) | set(peer)):
        a, b = ours.get(n), peer.get(n)
        counts = " / ".join(str(s.prompt_tokens) for s in (a, b) if s is not None)
        lines.append(
            f"| {n} | {counts} | {f'{a.ttft * 1000:.0f}' if a else 'n/a'} "
            f"| {f'{b.ttft * 1000:.0f}' if b else 'n/a'} "
            f"| {ratio(a.ttft, b.ttft) if a and b else 'n/a'} |"
        )
    return "\n".join(lines) + "\n"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def targets_table(results: dict[str, Run], args: argparse.Namespace) -> str:
    """The issue's targets: for the default model, one stream's ITL and the throughput at 16
    and 64 streams; for a --model file (the 1B test file), ITL, throughput at 8 and 16 streams
    and RSS; the long prompts' TTFT whenever they ran."""
    ours, peer = results.get(OURS, Run()), results.get(PEER, Run())
    lines = ["| target (from the issue) | measured | met |", "|---|---:|---|"]

    def row(label: str, a: float | None, b: float | None, limit: float, at_most: bool) -> None:
        if a is None or b is None:
            lines.append(f"| {label} | not measured | n/a |")
            return
        r = a / b if b > 0 else float("inf")
        met = r <= limit if at_most else r >= limit
        lines.append(f"| {label} | {r:.2f}x | {'yes' if met else '**no**'} |")

    def lvl(run: Run, c: int, key: str) -> float | None:
        return run.levels[c].summary()[key] if c in run.levels else None

    file_mode = args.model != "default"
    itl_target = ITL_TARGET_FILE if file_mode else ITL_TARGET
    if args.streams:
        row(f"1 stream: ITL p50 <= {itl_target}x llama.cpp's",
            lvl(ours, 1, "itl_p50"), lvl(peer, 1, "itl_p50"), itl_target, True)  # fmt: skip
        for c in (8, 16) if file_mode else (16, 64):
            row(f"{c} streams: output tok/s >= {TPUT_TARGET}x llama.cpp's",
                lvl(ours, c, "tok_s"), lvl(peer, c, "tok_s"), TPUT_TARGET, False)  # fmt: skip
        if file_mode:
            row(f"peak RSS serving (all processes) <= {RSS_TARGET}x llama.cpp's",
                ours.memory.peak if ours.memory else None,
                peer.memory.peak if peer.memory else None, RSS_TARGET, True)  # fmt: skip
    for n in args.long_prompts:
        if n < LONG_TARGET_FROM:
            continue
        a, b = ours.long.get(n), peer.long.get(n)
        row(f"prompt of ~{n} tokens: TTFT <= {LONG_TTFT_TARGET}x llama.cpp's",
            a.ttft if a else None, b.ttft if b else None, LONG_TTFT_TARGET, True)  # fmt: skip
    return "\n".join(lines) + "\n"


def full_report(
    args: argparse.Namespace,
    results: dict[str, Run],
    *,
    cmd: str,
    where: str,
    gguf: Path,
    binary: Path | None,
    peer_error: str | None,
    load_before: str,
) -> str:
    """The whole report: the run described (command, machine, both servers, the method),
    then the tables that ran and the targets."""
    peer_desc = (
        f"llama.cpp `llama-server` {llama_version(binary)} "
        f"(`-t {args.threads}`, CPU build, its defaults otherwise)"
        if binary is not None
        else "llama.cpp not measured (`--skip-llamacpp`)"
    )
    if peer_error:
        peer_desc += f" **which failed** ({peer_error})"
    ours_desc = (
        f"tokenrelay `serve --device cpu --weights {args.weights}` (embedded Redis, one "
        "worker, the gateway)"
        if not args.skip_ours
        else "tokenrelay not measured (`--skip-ours`)"
    )
    report = (
        f"{SECTION}\n\n"
        f"`{cmd}` on {where} ({time.strftime('%Y-%m-%d %H:%M')}). Model file `{gguf.name}` for "
        f"both: {ours_desc} and {peer_desc}. The same httpx async SSE client for "
        f"both, the servers one after the other with a warm-up request each: per level, each "
        f"client sends {args.requests_per_client} request(s) in a row, one fixed chat prompt, "
        f"{args.max_tokens} tokens, greedy, `ignore_eos`. TTFT: sending to the first content "
        f"chunk; ITL: the gaps between content chunks; output tok/s: completion tokens (usage) "
        f"over the level's wall time; RSS: VmRSS summed over the server's process tree. "
        f"1-minute load average {load_before.split()[0]} before, "
        f"{load_average().split()[0]} after (the machine is shared).\n\n"
    )
    if args.streams:
        report += report_table(results) + "\n" + memory_table(results) + "\n"
    if args.long_prompts:
        report += (
            f"Long prompts (one request each, {args.long_max_tokens} tokens out, the same "
            "prompt for both):\n\n" + long_table(results) + "\n"
        )
    report += targets_table(results, args)
    return report
